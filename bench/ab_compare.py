#!/usr/bin/python3
"""Before and after: two mha_bench binaries run alternately on the same benchmarks, and the medians.

On a shared machine whose speed changes by up to 1.5x within an hour, a change is measured by
alternating the binary before it with the binary after it, several rounds of several repetitions
each, and comparing medians (and minima, which single quiet moments decide). The table is
Markdown, for bench/RESULTS.md; the JSON of every run is kept with --keep DIR.

Usage:
  bench/ab_compare.py BEFORE AFTER --filter REGEX [--rounds 5] [--repetitions 3] [--min-time 0.3]

BEFORE and AFTER are mha_bench binaries (for example a build of the commit before the change, made
in a git worktree). Benchmarks present in only one binary are listed with the one time.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def run(binary, bench_filter, repetitions, min_time):
    """One run of `binary`: {benchmark name: [real times in ms]} and the run's context."""
    out = subprocess.run(
        [binary, f"--benchmark_filter={bench_filter}", f"--benchmark_repetitions={repetitions}",
         f"--benchmark_min_time={min_time}", "--benchmark_format=json"],
        check=True, capture_output=True, text=True).stdout
    data = json.loads(out)
    times = {}
    for b in data["benchmarks"]:
        if b.get("run_type") != "iteration" or "error_occurred" in b:
            continue
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        times.setdefault(b["run_name"], []).append(b["real_time"] * scale)
    return times, data["context"], out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--filter", required=True, help="--benchmark_filter for both binaries")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--keep", metavar="DIR", help="write each run's JSON into DIR")
    args = ap.parse_args(argv)

    samples = {"before": {}, "after": {}}
    contexts = {}
    for round_index in range(args.rounds):
        for side, binary in (("before", args.before), ("after", args.after)):
            times, context, raw = run(binary, args.filter, args.repetitions, args.min_time)
            contexts[side] = context
            for name, values in times.items():
                samples[side].setdefault(name, []).extend(values)
            if args.keep:
                os.makedirs(args.keep, exist_ok=True)
                with open(os.path.join(args.keep, f"{side}-{round_index}.json"), "w") as f:
                    f.write(raw)
            print(f"round {round_index + 1}/{args.rounds}: {side} done", file=sys.stderr)

    for side in ("before", "after"):
        c = contexts[side]
        ceilings = ", ".join(f"{k} {c[k]}" for k in ("fma_peak_GFLOPS", "memory_read_GB_per_s") if k in c)
        print(f"- {side}: `{getattr(args, side)}`; {c.get('num_cpus')} CPUs at {c.get('mhz_per_cpu')} MHz"
              + (f"; in-run ceilings: {ceilings}" if ceilings else ""))
    print()
    print("| benchmark | before, median ms | after, median ms | after / before | before, min | after, min |")
    print("|---|---|---|---|---|---|")
    names = sorted(set(samples["before"]) | set(samples["after"]))
    for name in names:
        b, a = samples["before"].get(name), samples["after"].get(name)
        cell = lambda xs, f: f"{f(xs):.2f}" if xs else "–"
        ratio = f"{statistics.median(a) / statistics.median(b):.2f}" if a and b else "–"
        print(f"| {name} | {cell(b, statistics.median)} | {cell(a, statistics.median)} | {ratio} | "
              f"{cell(b, min)} | {cell(a, min)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
