#!/usr/bin/python3
"""Reference fixtures for T5's bucketed relative-position bias (mha::mods::t5_bias, mha/mods.hpp),
computed by real torch.

Usage:
  /usr/bin/python3 tests/reference/generate_t5.py [--out DIR]   # default: tests/reference/data

Writes one float64 safetensors file per case, tests/reference/data/t5_<case>.safetensors, read by
tests/test_flex.cpp:

  buckets        [2·R + 1], the bucket of every relative position kv_idx - q_idx in [-R, R]
                 (R = 300, past max_distance), as float64 (exact integers)
  q, k, v        [H, L, D] float32 attention inputs (unbatched), normal(0, 1)
  table          [H, num_buckets] the learned bias, normal(0, 1)
  grad_output    [H, L, D] normal(0, 1)
  output         softmax(q kᵀ / sqrt(D) + bias) v, computed by torch in float32, where
                 bias[h, i, j] = table[h, bucket(j - i)]
  grad.table     torch autograd's gradient of (output · grad_output).sum() with respect to table
                 (float32)
  metadata       num_buckets, max_distance, bidirectional ("1" or "0"), description, torch_version

The buckets follow T5's definition (Raffel et al. 2020, and the Mesh TensorFlow code it
describes): n = -(kv_idx - q_idx); bidirectional gives half of the buckets to n < 0 and takes
|n|, unidirectional takes max(n, 0); below max_exact = (buckets per direction) / 2 each distance
has its bucket; from there the bucket is max_exact + trunc(log(n / max_exact) / log(max_distance /
max_exact) · (buckets per direction - max_exact)), at most the direction's last, computed in
float32 torch ops as T5's PyTorch implementations compute it. Every case has a fixed seed (the
CRC-32 of its name), so the files are reproducible byte for byte.
"""

import argparse
import math
import os
import sys
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import write_safetensors  # noqa: E402

REACH = 300


def t5_buckets(relative, num_buckets, max_distance, bidirectional):
    """relative: int64 tensor of kv_idx - q_idx. Returns int64 buckets, in torch ops."""
    bucket = torch.zeros_like(relative)
    n = -relative
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (n < 0).to(torch.long) * num_buckets
        n = torch.abs(n)
    else:
        n = torch.clamp(n, min=0)
    max_exact = num_buckets // 2
    logs = torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    large = max_exact + logs.to(torch.long)
    large = torch.minimum(large, torch.full_like(large, num_buckets - 1))
    return bucket + torch.where(n < max_exact, n, large)


def case(name, num_buckets, max_distance, bidirectional, H=2, L=70, D=8):
    seed = zlib.crc32(name.encode())
    gen = torch.Generator().manual_seed(seed)
    relative = torch.arange(-REACH, REACH + 1, dtype=torch.long)
    buckets = t5_buckets(relative, num_buckets, max_distance, bidirectional)
    # Each case reaches the log-spaced buckets and the cap.
    assert buckets.max().item() == num_buckets - 1
    q = torch.randn(H, L, D, generator=gen)
    k = torch.randn(H, L, D, generator=gen)
    v = torch.randn(H, L, D, generator=gen)
    table = torch.randn(H, num_buckets, generator=gen).requires_grad_(True)
    grad_output = torch.randn(H, L, D, generator=gen)
    positions = torch.arange(L)
    pair_buckets = t5_buckets(positions[None, :] - positions[:, None], num_buckets, max_distance,
                              bidirectional)  # [L, L]
    bias = table[:, pair_buckets]  # [H, L, L]
    scores = q @ k.transpose(-1, -2) / math.sqrt(D) + bias
    output = torch.softmax(scores, dim=-1) @ v
    (output * grad_output).sum().backward()
    tensors = {
        "buckets": buckets.numpy().astype(np.float64),
        "q": q.numpy(), "k": k.numpy(), "v": v.numpy(),
        "table": table.detach().numpy(),
        "grad_output": grad_output.numpy(),
        "output": output.detach().numpy(),
        "grad.table": table.grad.numpy(),
    }
    metadata = {
        "num_buckets": str(num_buckets), "max_distance": str(max_distance),
        "bidirectional": "1" if bidirectional else "0",
        "description": f"T5 relative bias, {num_buckets} buckets up to {max_distance}, "
                       f"{'bidirectional' if bidirectional else 'unidirectional'}",
        "torch_version": torch.__version__,
    }
    return tensors, metadata


CASES = [
    # T5's own settings, encoder and decoder.
    ("t5_encoder", 32, 128, True),
    ("t5_decoder", 32, 128, False),
    # Fewer buckets and a short reach, which a sequence of 70 passes.
    ("t5_short", 16, 20, True),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, num_buckets, max_distance, bidirectional in CASES:
        tensors, metadata = case(name, num_buckets, max_distance, bidirectional)
        path = os.path.join(args.out, name + ".safetensors")
        write_safetensors(path, tensors, metadata)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
