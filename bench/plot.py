#!/usr/bin/python3
"""Charts from bench/compare_pytorch.py's JSON (PyTorch nn.MultiheadAttention vs mha forward).

Usage (Debian's python3-matplotlib, so /usr/bin/python3):

    /usr/bin/python3 bench/plot.py heads.json length.json [more.json ...] [--out-dir bench/charts]

Each input file is one compare_pytorch.py run; files with the same sweep, mha kernel and thread
count are merged (a configuration measured twice keeps the later file's row). Written PNGs, with
<tag> = <sweep>_<kernel>_t<threads>:
    heads sweep   <tag>_time.png    time vs H (log2 axis), one panel per (E, L), torch vs mha
                  <tag>_ratio.png   torch/mha vs H, one line per (E, L) (> 1: mha faster)
    length sweep  <tag>_time.png    time vs L, log-log, torch vs mha
                  <tag>_gflops.png  GFLOP/s vs L (log2 axis), torch vs mha
    default or --config runs
                  <tag>_time.png    grouped bars per configuration, log time axis, ratio on top
Titles carry the CPU model, nproc, thread count, mha kernel and torch version. Configurations that
a side skipped (memory or time guard) or that mha_bench does not register are listed under the
chart. Exit status: 0 when charts were written, 1 when no input had a plottable row, 2 when an
input is missing or not compare_pytorch.py JSON.
"""
import argparse
import collections
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

TORCH_STYLE = dict(color="tab:orange", marker="o", label="PyTorch nn.MultiheadAttention")
MHA_STYLE = dict(color="tab:blue", marker="s", label="mha forward/{kernel}")


def load(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error}") from error
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON: {error}") from error
    if not isinstance(data, dict) or "meta" not in data or "rows" not in data:
        raise ValueError(f"{path} is not compare_pytorch.py output (no meta/rows)")
    meta = data["meta"]
    for key in ("sweep", "kernel", "threads"):
        if key not in meta:
            raise ValueError(f"{path}: meta has no {key!r}")
    return meta, data["rows"]


def positive(value):
    return value is not None and isinstance(value, (int, float)) and value > 0 \
        and not math.isnan(value)


def title_suffix(meta):
    return (f"{meta.get('cpu_model', '?')}, nproc {meta.get('nproc', '?')}, "
            f"{meta['threads']} thread{'s' if meta['threads'] != 1 else ''}, "
            f"mha kernel '{meta['kernel']}', torch {meta.get('torch_version', '?')}")


def skipped_notes(rows, key):
    """Lines like "torch skipped (memory): L=16384" for rows a side did not measure."""
    by_reason = collections.defaultdict(list)
    for row in rows:
        for side in ("torch", "mha"):
            status = row.get(f"{side}_status", "ok")
            if status != "ok":
                by_reason[f"{side} {status}"].append(key(row))
    return [f"{reason}: {', '.join(items)}" for reason, items in sorted(by_reason.items())]


def finish(fig, path, notes, meta):
    if notes:
        text = "\n".join(notes)
        if len(text) > 600:
            text = text[:600] + " ..."
        fig.text(0.01, 0.005, text, fontsize=7, va="bottom", ha="left", wrap=True)
    if meta.get("date"):
        fig.text(0.995, 0.995, meta["date"], fontsize=6, va="top", ha="right", color="gray")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def log2_axis(ax, values):
    ax.set_xscale("log", base=2)
    ax.set_xticks(values)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def series(rows, x_key, y_key):
    points = sorted((row[x_key], row[y_key]) for row in rows if positive(row.get(y_key)))
    return [p[0] for p in points], [p[1] for p in points]


def plot_heads(meta, rows, out_dir, tag):
    written = []
    es = sorted({row["E"] for row in rows})
    ls = sorted({row["L"] for row in rows})
    hs = sorted({row["H"] for row in rows})
    fig, axes = plt.subplots(len(es), len(ls), figsize=(4.2 * len(ls), 3.2 * len(es) + 1.2),
                             squeeze=False)
    for i, e in enumerate(es):
        for j, l in enumerate(ls):
            ax = axes[i][j]
            panel = [row for row in rows if row["E"] == e and row["L"] == l]
            for key, style in (("torch_ms", TORCH_STYLE), ("mha_ms", MHA_STYLE)):
                x, y = series(panel, "H", key)
                if x:
                    ax.plot(x, y, **dict(style, label=style["label"].format(**meta)))
            log2_axis(ax, [h for h in hs if any(row["H"] == h for row in panel)] or hs)
            ax.set_ylim(bottom=0)
            ax.set_title(f"E={e}, L={l}, B={panel[0]['B'] if panel else '?'}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if i == len(es) - 1:
                ax.set_xlabel("heads H")
            if j == 0:
                ax.set_ylabel("forward time (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle(f"MHA forward time vs heads\n{title_suffix(meta)}", fontsize=11, y=0.995)
    notes = skipped_notes(rows, lambda r: f"E={r['E']}/L={r['L']}/H={r['H']}")
    top = 1 - 0.85 / fig.get_figheight()  # room for the two-line title and the legend
    fig.tight_layout(rect=(0, 0.06 if notes else 0, 1, top))
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, top), ncol=2, fontsize=8,
               frameon=False)
    path = os.path.join(out_dir, f"{tag}_time.png")
    finish(fig, path, notes, meta)
    written.append(path)

    ratio_rows = [row for row in rows if positive(row.get("ratio"))]
    if ratio_rows:
        fig, ax = plt.subplots(figsize=(8, 5.2))
        for e in es:
            for l in ls:
                x, y = series([r for r in ratio_rows if r["E"] == e and r["L"] == l], "H", "ratio")
                if x:
                    ax.plot(x, y, marker="o", label=f"E={e}, L={l}")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        log2_axis(ax, hs)
        ax.set_xlabel("heads H")
        ax.set_ylabel("torch time / mha time  (> 1: mha faster)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(f"Speed ratio vs heads\n{title_suffix(meta)}", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{tag}_ratio.png")
        finish(fig, path, [], meta)
        written.append(path)
    return written


def plot_length(meta, rows, out_dir, tag):
    written = []
    groups = sorted({(row["B"], row["E"], row["H"]) for row in rows})
    ls = sorted({row["L"] for row in rows})
    notes = skipped_notes(rows, lambda r: f"L={r['L']}" + ("" if len(groups) == 1 else
                                                          f"(B={r['B']},E={r['E']},H={r['H']})"))

    for what, keys, ylabel, name in (
            ("time", ("torch_ms", "mha_ms"), "forward time (ms)", "time"),
            ("GFLOP/s", ("torch_gflops", "mha_gflops"),
             "GFLOP/s  (FLOPs = B(8LE² + 4L²E))", "gflops")):
        fig, ax = plt.subplots(figsize=(8, 5.4))
        for b, e, h in groups:
            group = [row for row in rows if (row["B"], row["E"], row["H"]) == (b, e, h)]
            suffix = "" if len(groups) == 1 else f" (B={b}, E={e}, H={h})"
            for key, style in zip(keys, (TORCH_STYLE, MHA_STYLE)):
                x, y = series(group, "L", key)
                if x:
                    ax.plot(x, y, **dict(style, label=style["label"].format(**meta) + suffix))
        log2_axis(ax, ls)
        if name == "time":
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10))
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length L (self-attention, L = S)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        shape = (f"B={groups[0][0]}, E={groups[0][1]}, H={groups[0][2]}"
                 if len(groups) == 1 else "several shapes")
        ax.set_title(f"MHA forward {what} vs sequence length, {shape}\n{title_suffix(meta)}",
                     fontsize=9)
        fig.tight_layout(rect=(0, 0.06 if notes else 0, 1, 1))
        path = os.path.join(out_dir, f"{tag}_{name}.png")
        finish(fig, path, notes, meta)
        written.append(path)
    return written


def plot_configs(meta, rows, out_dir, tag):
    rows = sorted(rows, key=lambda r: (r["L"], r["E"], r["B"], r["H"]))
    labels = [f"B={r['B']} L={r['L']}\nE={r['E']} H={r['H']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2), 5.4))
    width = 0.38
    for offset, key, style in ((-width / 2, "torch_ms", TORCH_STYLE),
                               (width / 2, "mha_ms", MHA_STYLE)):
        xs = [i + offset for i, r in enumerate(rows) if positive(r.get(key))]
        ys = [r[key] for r in rows if positive(r.get(key))]
        ax.bar(xs, ys, width, color=style["color"], label=style["label"].format(**meta))
    ax.set_yscale("log")
    for i, r in enumerate(rows):
        heights = [r[k] for k in ("torch_ms", "mha_ms") if positive(r.get(k))]
        if heights:
            text = f"×{r['ratio']:.2f}" if positive(r.get("ratio")) else "—"
            ax.annotate(text, (i, max(heights)), textcoords="offset points", xytext=(0, 3),
                        ha="center", fontsize=8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("forward time (ms, log scale)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"MHA forward time per configuration (labels: torch/mha, > 1 means mha faster)"
                 f"\n{title_suffix(meta)}", fontsize=9)
    notes = skipped_notes(rows, lambda r: f"B={r['B']}/L={r['L']}/E={r['E']}/H={r['H']}")
    fig.tight_layout(rect=(0, 0.06 if notes else 0, 1, 1))
    path = os.path.join(out_dir, f"{tag}_time.png")
    finish(fig, path, notes, meta)
    return [path]


def main():
    parser = argparse.ArgumentParser(description="Charts from compare_pytorch.py JSON files.")
    parser.add_argument("inputs", nargs="+", metavar="results.json")
    parser.add_argument("--out-dir", default=os.path.join("bench", "charts"))
    args = parser.parse_args()

    groups = collections.OrderedDict()  # (sweep, kernel, threads) -> (meta, {config: row})
    for path in args.inputs:
        try:
            meta, rows = load(path)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        key = (meta["sweep"], meta["kernel"], meta["threads"])
        if key not in groups:
            groups[key] = (meta, collections.OrderedDict())
        merged = groups[key][1]
        for row in rows:
            config = (row["B"], row["L"], row["E"], row["H"])
            if config in merged:
                print(f"note: {path} replaces B:{config[0]}/L:{config[1]}/E:{config[2]}/"
                      f"H:{config[3]} of an earlier file", file=sys.stderr)
            merged[config] = row
        if not meta.get("complete", True):
            print(f"note: {path} is from an interrupted run", file=sys.stderr)

    os.makedirs(args.out_dir, exist_ok=True)
    written = []
    for (sweep, kernel, threads), (meta, merged) in groups.items():
        rows = [row for row in merged.values()
                if positive(row.get("torch_ms")) or positive(row.get("mha_ms"))]
        if not rows:
            print(f"note: nothing measured in the {sweep} sweep (kernel {kernel}, "
                  f"{threads} threads); no chart", file=sys.stderr)
            continue
        tag = f"{sweep}_{kernel}_t{threads}"
        plotter = {"heads": plot_heads, "length": plot_length}.get(sweep, plot_configs)
        written += plotter(meta, list(merged.values()), args.out_dir, tag)
    if not written:
        print("error: no plottable rows in the input", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
