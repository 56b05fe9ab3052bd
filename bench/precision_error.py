#!/usr/bin/python3
"""Output error of reduced-precision attention (mha, PyTorch, ONNX Runtime) on the same inputs.

    /usr/bin/python3 bench/precision_error.py --mha-run build/tools/mha_run [--json out.json]
        [--work-dir /tmp] [--config B,L,E,H ...] [--ort-node node_modules/onnxruntime-node]

For each configuration: a torch.nn.MultiheadAttention(E, H, batch_first=True) with torch's own
initialisation (seed 0) and a randn input x [B, L, E] (self-attention, need_weights=False). The
reference is that layer in float64. Measured against it, as max |y - y64| / max |y64|:
  * torch fp32 (the inference fast path),
  * torch bf16 autocast (torch.autocast("cpu", dtype=torch.bfloat16) under no_grad, the layer in
    train mode with dropout 0, since torch 1.13's fast path fails under CPU autocast),
  * mha fp32 and mha bf16 (mha_run on the same state_dict and x, metadata precision "fp32" or
    "bf16"; bf16 runs in fp32 where the CPU lacks AVX512_BF16, which mha_run does not report:
    the script prints whether /proc/cpuinfo lists avx512_bf16),
  * mha int8 weights (metadata weights "int8": the four projection weights quantized to int8,
    symmetric, one scale per output row, the products in fp32 on those values) and mha int8
    (weights "int8" and precision "int8": besides, each row (token) of a projection's input
    quantized to int8 at the call, symmetric, one scale per row, int8 x int8 products; fp32
    products on the int8 weights where the CPU lacks AVX512_VNNI: the script prints whether
    /proc/cpuinfo lists avx512_vnni). The attention core stays in fp32.
  * with --ort-node (the onnxruntime-node package's directory; run by node through
    bench/ort_run.js, one thread, all graph optimisations): ONNX Runtime on the same weights and
    x, in a graph written here with python3-onnx as bench/compare_ort.py writes its own (MatMul +
    Add for Q, K and V together, Split, the com.microsoft MultiHeadAttention op, MatMul + Add for
    W_O): ort fp32 that graph; ort int8 per tensor and per channel the graph
    onnxruntime.quantization.quantize_dynamic makes of it in its default QOperator (IntegerOps)
    format, built here by hand since its Python package is not installed. Each of the two MatMuls
    becomes DynamicQuantizeLinear of its input (uint8, asymmetric, one scale and zero point for
    the whole tensor, computed at each run), MatMulInteger with the weight stored as an int8
    initializer (weight_type QInt8, hence symmetric: values in [-127, 127], zero point 0, scale
    max |w| / 127), Cast to float, Mul by input scale x weight scale; the bias Add stays in fp32.
    "per tensor" is quantize_dynamic's default (one scale for each weight, the Q, K and V weight
    sharing one); "per channel" is its per_channel=True (one scale per column of the MatMul's
    weight, i.e. per output, as mha's). reduce_range is off, as by default.
The safetensors reader and writer are tests/reference/generate.py's."""
import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIGS = [(4, 128, 768, 12), (1, 512, 512, 8), (1, 2048, 512, 8), (1, 1024, 1024, 16)]
# mha_run's metadata for each mha column.
MHA_PATHS = {"mha_fp32": {"precision": "fp32"}, "mha_bf16": {"precision": "bf16"},
             "mha_int8_weights": {"weights": "int8"},
             "mha_int8": {"weights": "int8", "precision": "int8"}}
# The weight quantization of each ONNX Runtime column (None: the float graph).
ORT_PATHS = {"ort_fp32": None, "ort_int8_per_tensor": "per_tensor",
             "ort_int8_per_channel": "per_channel"}


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


def run_mha(generate, mha_run, work_dir, state, x, heads, options):
    tensors = {name: t.detach().numpy().astype(np.float32) for name, t in state.items()}
    for name in ("query", "key", "value"):
        tensors[name] = x
    in_path = os.path.join(work_dir, "precision_error.in.safetensors")
    out_path = os.path.join(work_dir, "precision_error.out.safetensors")
    generate.write_safetensors(in_path, tensors, {"num_heads": str(heads), "need_weights": "0",
                                                  **options})
    run = subprocess.run([mha_run, in_path, out_path], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"mha_run failed ({run.returncode}): {run.stderr.strip()}")
    with open(out_path, "rb") as f:
        outputs, _ = generate.parse_safetensors(f.read())
    os.remove(in_path)
    os.remove(out_path)
    return outputs["output"]


def quantize_weight(w, per_channel):
    """A MatMul's weight w [K, N] as quantize_dynamic stores it with weight_type QInt8: symmetric
    int8 in [-127, 127], zero point 0, scale max |w| / 127 over w or, per channel, over each
    column. Returns the int8 values, the scale(s) and the zero point(s)."""
    largest = np.abs(w).max(axis=0) if per_channel else np.abs(w).max()
    scale = np.where(largest > 0, largest / 127, 1).astype(np.float32)
    values = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return values, scale, np.zeros(scale.shape, np.int8)


def add_projection(onnx, nodes, initializers, source, w, b, target, quantization):
    """Appends target = source @ w + b to a graph's nodes and initializers: MatMul + Add, or with
    quantization ("per_tensor" or "per_channel") the MatMul as quantize_dynamic rewrites it."""

    def constant(name, array):
        initializers.append(onnx.numpy_helper.from_array(array, f"{target}.{name}"))
        return f"{target}.{name}"

    make_node = onnx.helper.make_node
    product = f"{target}.product"
    if quantization is None:
        nodes.append(make_node("MatMul", [source, constant("w", w)], [product]))
    else:
        values, scale, zero_point = quantize_weight(w, quantization == "per_channel")
        q, q_scale, q_zero_point = f"{source}.q", f"{source}.scale", f"{source}.zero_point"
        nodes += [
            make_node("DynamicQuantizeLinear", [source], [q, q_scale, q_zero_point]),
            make_node("MatMulInteger", [q, constant("w_q", values), q_zero_point,
                                        constant("w_zero_point", zero_point)],
                      [f"{target}.int32"]),
            make_node("Cast", [f"{target}.int32"], [f"{target}.float"],
                      to=onnx.TensorProto.FLOAT),
            make_node("Mul", [q_scale, constant("w_scale", scale)], [f"{target}.scale"]),
            make_node("Mul", [f"{target}.float", f"{target}.scale"], [product]),
        ]
    nodes.append(make_node("Add", [product, constant("b", b)], [target]))


def ort_model(onnx, state, shape, heads, quantization):
    """The layer in state as an ONNX self-attention forward of x [B, L, E] (see the docstring)."""
    weights = {name: t.detach().numpy().astype(np.float32) for name, t in state.items()}
    e = shape[2]
    nodes, initializers = [], [onnx.numpy_helper.from_array(np.array([e, e, e], np.int64), "split")]
    add_projection(onnx, nodes, initializers, "x", weights["in_proj_weight"].T,
                   weights["in_proj_bias"], "qkv", quantization)
    nodes += [
        onnx.helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=2),
        onnx.helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["attention"],
                              domain="com.microsoft", num_heads=heads),
    ]
    add_projection(onnx, nodes, initializers, "attention", weights["out_proj.weight"].T,
                   weights["out_proj.bias"], "y", quantization)
    float_info = onnx.helper.make_tensor_value_info
    model = onnx.helper.make_model(
        onnx.helper.make_graph(nodes, "mha", [float_info("x", onnx.TensorProto.FLOAT, shape)],
                               [float_info("y", onnx.TensorProto.FLOAT, shape)], initializers),
        opset_imports=[onnx.helper.make_opsetid("", 17),
                       onnx.helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def run_ort(onnx, ort_node, work_dir, model, x):
    paths = [os.path.join(work_dir, f"precision_error.{suffix}") for suffix in ("onnx", "x", "y")]
    onnx.save(model, paths[0])
    x.astype("<f4").tofile(paths[1])
    run = subprocess.run(["node", os.path.join(HERE, "ort_run.js"), *paths,
                          *(str(n) for n in x.shape)],
                         capture_output=True, text=True, env={**os.environ, "ORT_NODE": ort_node})
    if run.returncode != 0:
        sys.exit(f"ort_run.js failed ({run.returncode}): {run.stderr.strip()}")
    y = np.fromfile(paths[2], "<f4").reshape(x.shape)
    for path in paths:
        os.remove(path)
    return y


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mha-run", required=True)
    parser.add_argument("--json")
    parser.add_argument("--work-dir", default="/tmp")
    parser.add_argument("--config", type=parse_config, action="append", metavar="B,L,E,H")
    parser.add_argument("--ort-node", metavar="PATH",
                        help="onnxruntime-node's package directory (without it: no ort columns)")
    args = parser.parse_args()
    generate = load_generate()
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    has_bf16, has_vnni = "avx512_bf16" in flags, "avx512_vnni" in flags
    onnx, ort_version = None, None
    if args.ort_node:
        if shutil.which("node") is None:
            sys.exit("--ort-node needs node on the PATH")
        import onnx
        import onnx.numpy_helper
        with open(os.path.join(args.ort_node, "package.json")) as f:
            ort_version = json.load(f)["version"]
    columns = ["torch_fp32", "torch_bf16_autocast", *MHA_PATHS, *(ORT_PATHS if onnx else [])]
    torch.set_num_threads(2)
    rows = []
    print(f"# torch {torch.__version__}; this CPU lists avx512_bf16: {has_bf16}, "
          f"avx512_vnni: {has_vnni}")
    if onnx:
        print(f"# onnx {onnx.__version__}, onnxruntime-node {ort_version}")
    else:
        print("# ONNX Runtime skipped (no --ort-node)")
    print(" | ".join(["B, L, E, H", *columns]))
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
        outputs = {"torch_fp32": torch_fp32, "torch_bf16_autocast": torch_bf16}
        for name, options in MHA_PATHS.items():
            outputs[name] = run_mha(generate, args.mha_run, args.work_dir, state, x_np, h, options)
        if onnx:
            for name, quantization in ORT_PATHS.items():
                model = ort_model(onnx, state, [b, l, e], h, quantization)
                outputs[name] = run_ort(onnx, args.ort_node, args.work_dir, model, x_np)
        row = {"B": b, "L": l, "E": e, "H": h,
               **{name: error(outputs[name], reference) for name in columns}}
        rows.append(row)
        print(" | ".join([f"{b}, {l}, {e}, {h}", *(f"{row[name]:.2e}" for name in columns)]),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch_version": torch.__version__, "avx512_bf16": has_bf16,
                       "avx512_vnni": has_vnni,
                       "onnx_version": onnx.__version__ if onnx else None,
                       "onnxruntime_node_version": ort_version,
                       "command": " ".join([sys.executable, *sys.argv]), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
