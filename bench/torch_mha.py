#!/usr/bin/python3
"""Times torch.nn.MultiheadAttention forward (need_weights=False, eval, fp32) for the shapes of
bench/mha_bench.cpp, to compare with it in the same session. Run with Debian's python3-torch:
    /usr/bin/python3 bench/torch_mha.py [--repeats 7] [--threads 2]
Prints one line per shape: the median time and GFLOP/s, FLOPs counted as in mha_bench
(8·n·E² + 4·n²·E per batch element)."""
import argparse
import statistics
import time

import torch

SHAPES = [(1, 128, 768, 12), (8, 128, 512, 8), (1, 1024, 512, 8)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for b, n, e, h in SHAPES:
        layer = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
        x = torch.randn(b, n, e)
        with torch.no_grad():
            layer(x, x, x, need_weights=False)  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                layer(x, x, x, need_weights=False)
                times.append(time.perf_counter() - start)
        median = statistics.median(times)
        flops = b * (8 * n * e * e + 4 * n * n * e)
        print(f"forward/torch/B:{b}/L:{n}/E:{e}/H:{h}  median {median * 1e3:.2f} ms  "
              f"{flops / median * 1e-9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
