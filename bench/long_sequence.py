#!/usr/bin/python3
"""Peak memory and time of one long self-attention through mha_run, without weights.

    /usr/bin/python3 bench/long_sequence.py --mha-run build/tools/mha_run [--length 32768]
        [--embed 512] [--heads 8] [--work-dir /tmp]

Writes IN.safetensors (a random nn.MultiheadAttention's parameters and query = key = value of
[1, L, E], fp32, need_weights 0) with numpy only, runs mha_run under /usr/bin/time -v and prints
the wall time and the peak resident memory (inputs and outputs included). Stored scores would
take H·L²·4 bytes, also printed."""
import argparse
import json
import os
import re
import struct
import subprocess
import sys

import numpy as np


def write_safetensors(path, tensors, metadata):
    header, offset = {}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for array in tensors.values():
            out.write(np.ascontiguousarray(array, dtype="<f4").tobytes())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mha-run", required=True)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--embed", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--work-dir", default="/tmp")
    args = parser.parse_args()
    n, e = args.length, args.embed
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, n, e), dtype=np.float32)
    tensors = {
        "in_proj_weight": rng.uniform(-0.05, 0.05, (3 * e, e)).astype(np.float32),
        "in_proj_bias": np.zeros(3 * e, np.float32),
        "out_proj.weight": rng.uniform(-0.05, 0.05, (e, e)).astype(np.float32),
        "out_proj.bias": np.zeros(e, np.float32),
        "query": x, "key": x, "value": x,
    }
    in_path = os.path.join(args.work_dir, f"long_{n}.in.safetensors")
    out_path = os.path.join(args.work_dir, f"long_{n}.out.safetensors")
    write_safetensors(in_path, tensors, {"num_heads": str(args.heads), "need_weights": "0"})
    del tensors, x
    run = subprocess.run(["/usr/bin/time", "-v", args.mha_run, in_path, out_path],
                         capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"mha_run failed ({run.returncode}): {run.stderr.strip()}")
    peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", run.stderr).group(1)
    print(f"B=1 L={n} E={e} H={args.heads}: wall {wall}, peak RSS {peak_kib / 1024:.0f} MiB; "
          f"input file {os.path.getsize(in_path) / 2**20:.0f} MiB; stored scores would take "
          f"{args.heads * n * n * 4 / 2**30:.1f} GiB")
    os.remove(in_path)
    os.remove(out_path)


if __name__ == "__main__":
    main()
