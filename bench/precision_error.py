#!/usr/bin/python3
"""Output error of reduced-precision attention, mha's and PyTorch's, on the same inputs.

    /usr/bin/python3 bench/precision_error.py --mha-run build/tools/mha_run [--json out.json]
        [--work-dir /tmp] [--config B,L,E,H ...]

For each configuration: a torch.nn.MultiheadAttention(E, H, batch_first=True) with torch's own
initialisation (seed 0) and a randn input x [B, L, E] (self-attention, need_weights=False). The
reference is that layer in float64. Measured against it, as max |y - y64| / max |y64|:
  * torch fp32 (the inference fast path),
  * torch bf16 autocast (torch.autocast("cpu", dtype=torch.bfloat16) under no_grad, the layer in
    train mode with dropout 0, since torch 1.13's fast path fails under CPU autocast),
  * mha fp32 and mha bf16 (mha_run on the same state_dict and x, metadata precision "fp32" or
    "bf16"; bf16 runs in fp32 where the CPU lacks AVX512_BF16, which mha_run does not report:
    the script prints whether /proc/cpuinfo lists avx512_bf16).
The safetensors reader and writer are tests/reference/generate.py's."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIGS = [(4, 128, 768, 12), (1, 512, 512, 8), (1, 2048, 512, 8), (1, 1024, 1024, 16)]


def load_generate():
    path = os.path.join(HERE, "..", "tests", "reference", "generate.py")
    spec = importlib.util.spec_from_file_location("generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_config(text):
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 4 or parts[2] % parts[3] != 0:
        raise argparse.ArgumentTypeError(f"expected B,L,E,H with H dividing E, got {text!r}")
    return tuple(parts)


def error(actual, reference):
    return float(np.max(np.abs(actual.astype(np.float64) - reference)) / np.max(np.abs(reference)))


def run_mha(generate, mha_run, work_dir, state, x, heads, precision):
    tensors = {name: t.detach().numpy().astype(np.float32) for name, t in state.items()}
    for name in ("query", "key", "value"):
        tensors[name] = x
    in_path = os.path.join(work_dir, "precision_error.in.safetensors")
    out_path = os.path.join(work_dir, "precision_error.out.safetensors")
    generate.write_safetensors(in_path, tensors, {"num_heads": str(heads), "need_weights": "0",
                                                  "precision": precision})
    run = subprocess.run([mha_run, in_path, out_path], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"mha_run failed ({run.returncode}): {run.stderr.strip()}")
    with open(out_path, "rb") as f:
        outputs, _ = generate.parse_safetensors(f.read())
    os.remove(in_path)
    os.remove(out_path)
    return outputs["output"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mha-run", required=True)
    parser.add_argument("--json")
    parser.add_argument("--work-dir", default="/tmp")
    parser.add_argument("--config", type=parse_config, action="append", metavar="B,L,E,H")
    args = parser.parse_args()
    generate = load_generate()
    with open("/proc/cpuinfo") as f:
        has_bf16 = "avx512_bf16" in f.read()
    torch.set_num_threads(2)
    rows = []
    print(f"# torch {torch.__version__}; this CPU lists avx512_bf16: {has_bf16}")
    print("B, L, E, H | torch fp32 | torch bf16 autocast | mha fp32 | mha bf16")
    for b, l, e, h in args.config or DEFAULT_CONFIGS:
        torch.manual_seed(0)
        layer = torch.nn.MultiheadAttention(e, h, batch_first=True)
        x = torch.randn(b, l, e)
        with torch.no_grad():
            wide = layer.double().eval()
            reference = wide(x.double(), x.double(), x.double(), need_weights=False)[0].numpy()
            layer = layer.float()
            with torch.inference_mode():
                torch_fp32 = layer.eval()(x, x, x, need_weights=False)[0].numpy()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch_bf16 = layer.train()(x, x, x, need_weights=False)[0].float().numpy()
        state = layer.state_dict()
        x_np = x.numpy()
        mha_fp32 = run_mha(generate, args.mha_run, args.work_dir, state, x_np, h, "fp32")
        mha_bf16 = run_mha(generate, args.mha_run, args.work_dir, state, x_np, h, "bf16")
        row = {"B": b, "L": l, "E": e, "H": h, "torch_fp32": error(torch_fp32, reference),
               "torch_bf16_autocast": error(torch_bf16, reference),
               "mha_fp32": error(mha_fp32, reference), "mha_bf16": error(mha_bf16, reference)}
        rows.append(row)
        print(f"{b}, {l}, {e}, {h} | {row['torch_fp32']:.2e} | {row['torch_bf16_autocast']:.2e} | "
              f"{row['mha_fp32']:.2e} | {row['mha_bf16']:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch_version": torch.__version__, "avx512_bf16": has_bf16,
                       "command": " ".join([sys.executable, *sys.argv]), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
