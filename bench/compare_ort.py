#!/usr/bin/python3
"""Compare mha's forward pass with ONNX Runtime's (and PyTorch's), alternating them in one run.

Usage (Debian's python3-onnx and python3-torch, so /usr/bin/python3):

    /usr/bin/python3 bench/compare_ort.py --mha-bench build/bench/mha_bench \
        [--config B,L,E,H ...] [--threads 2] [--rounds 3] [--repeats 5] [--no-torch] [--json out.json]

Without --config: the issue's configurations (B, L, E, H) = (1,128,768,12) (8,128,512,8)
(1,512,512,8) (1,2048,512,8) (1,4096,512,8) (1,2048,1024,16) (4,512,1024,16) (1,2048,512,64).

ONNX Runtime: the npm package onnxruntime-node (its CPU library ships inside it), run by node
with a timer this script writes, on a model this script writes with python3-onnx: one
self-attention forward as ONNX Runtime runs it fastest on a CPU, MatMul + Add for Q, K and V
together, the com.microsoft MultiHeadAttention op (MLAS's flash attention), MatMul + Add for
W_O; session options intraOpNumThreads = --threads, interOpNumThreads 1, all graph
optimisations. The package is looked for in $ORT_NODE, then in --ort-dir (default
~/.cache/mha-bench-ort), where the script installs it with
`npm install --ignore-scripts onnxruntime-node@1.30.0` if npm is there (--ignore-scripts skips a
post-install step that would download GPU binaries), else it says how and stops. Neither npm nor
ONNX Runtime is a dependency of the library or its tests.

mha: `mha_bench --benchmark_filter=^forward/auto/B:<b>/L:<l>/E:<e>/H:<h>$` (the layer, which packs
its weights at every call, as they may change between calls), and `forward_frozen/auto/...` (a
FrozenMultiHeadAttention, its weights packed once, as ONNX Runtime packs them when the session is
made), --repeats repetitions, the median aggregate, OMP_NUM_THREADS=--threads. PyTorch: nn.MultiheadAttention in eval mode under
inference_mode, need_weights=False, as bench/compare_pytorch.py times it (OPENBLAS_NUM_THREADS and
OMP_WAIT_POLICY=PASSIVE set for this process before torch is imported, torch.set_num_threads).

Each round runs ONNX Runtime, mha's layer, the frozen layer and PyTorch in turn on a configuration;
reported per configuration: the median over all rounds of each one's per-round median, GFLOP/s with
FLOPs = B·(8·L·E² + 4·L²·E), and mha's speed-ups over each (> 1: mha is faster).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ORT_VERSION = "1.30.0"
ISSUE_CONFIGS = [(1, 128, 768, 12), (8, 128, 512, 8), (1, 512, 512, 8), (1, 2048, 512, 8),
                 (1, 4096, 512, 8), (1, 2048, 1024, 16), (4, 512, 1024, 16), (1, 2048, 512, 64)]

# The timer node runs: the median and minimum seconds of `reps` runs after one warm-up.
TIMER_JS = r"""
const ort = require(process.env.ORT_NODE);
async function main() {
  const [model, B, L, E, reps, threads] = [process.argv[2], ...process.argv.slice(3).map(Number)];
  const s = await ort.InferenceSession.create(model, {intraOpNumThreads: threads,
    interOpNumThreads: 1, graphOptimizationLevel: 'all', executionMode: 'sequential'});
  const x = new ort.Tensor('float32', Float32Array.from({length: B * L * E}, () => Math.random() - 0.5),
                           [B, L, E]);
  await s.run({x});
  const ts = [];
  for (let i = 0; i < reps; i++) {
    const t = process.hrtime.bigint();
    await s.run({x});
    ts.push(Number(process.hrtime.bigint() - t) / 1e9);
  }
  ts.sort((a, b) => a - b);
  console.log(JSON.stringify({median: ts[Math.floor(ts.length / 2)], min: ts[0]}));
}
main().catch(e => { console.error(e.message); process.exit(1); });
"""


def fail(message):
    print(f"compare_ort: {message}", file=sys.stderr)
    sys.exit(1)


def flops(b, l, e):
    return b * (8 * l * e * e + 4 * l * l * e)


def ort_package(ort_dir):
    """The onnxruntime-node package directory, installed into ort_dir if it is nowhere yet."""
    if os.environ.get("ORT_NODE"):
        return os.environ["ORT_NODE"]
    package = os.path.join(ort_dir, "node_modules", "onnxruntime-node")
    if os.path.isdir(package):
        return package
    command = ["npm", "install", "--ignore-scripts", "--prefix", ort_dir, f"onnxruntime-node@{ORT_VERSION}"]
    if shutil.which("npm") is None or shutil.which("node") is None:
        fail("needs node and npm for ONNX Runtime (apt-get install nodejs npm), then: " + " ".join(command))
    os.makedirs(ort_dir, exist_ok=True)
    print("compare_ort: installing ONNX Runtime: " + " ".join(command), file=sys.stderr)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return package


def write_model(path, b, l, e, h):
    """The self-attention forward of the module docstring, random weights (speed does not depend on them)."""
    try:
        import numpy as np
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as error:
        fail(f"cannot import onnx ({error}): apt-get install python3-onnx, and run with /usr/bin/python3")
    r = np.random.default_rng(0)
    inits = [numpy_helper.from_array((r.standard_normal((e, 3 * e)) * e ** -0.5).astype(np.float32), "w_qkv"),
             numpy_helper.from_array(np.zeros(3 * e, np.float32), "b_qkv"),
             numpy_helper.from_array((r.standard_normal((e, e)) * e ** -0.5).astype(np.float32), "w_o"),
             numpy_helper.from_array(np.zeros(e, np.float32), "b_o"),
             numpy_helper.from_array(np.array([e, e, e], np.int64), "split")]
    nodes = [helper.make_node("MatMul", ["x", "w_qkv"], ["qkv0"]),
             helper.make_node("Add", ["qkv0", "b_qkv"], ["qkv"]),
             helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=2),
             helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["att"], domain="com.microsoft",
                              num_heads=h),
             helper.make_node("MatMul", ["att", "w_o"], ["y0"]),
             helper.make_node("Add", ["y0", "b_o"], ["y"])]
    graph = helper.make_graph(nodes, "mha", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, l, e])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, l, e])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    onnx.save(model, path)


def ort_seconds(package, timer, model, config, repeats, threads):
    b, l, e, _ = config
    out = subprocess.run(["node", timer, model, str(b), str(l), str(e), str(repeats), str(threads)],
                         check=True, capture_output=True, text=True, env={**os.environ, "ORT_NODE": package})
    return json.loads(out.stdout)["median"]


def mha_seconds(binary, config, repeats, threads, variant="forward"):
    b, l, e, h = config
    return benchmark_seconds(binary, f"{variant}/auto/B:{b}/L:{l}/E:{e}/H:{h}", repeats, threads)


def benchmark_seconds(binary, name, repeats, threads):
    """mha_bench's median seconds of the benchmark `name` over `repeats` repetitions, and its context."""
    out = subprocess.run([binary, f"--benchmark_filter=^{name}$", f"--benchmark_repetitions={repeats}",
                          "--benchmark_report_aggregates_only=true", "--benchmark_format=json"],
                         check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    data = json.loads(out.stdout)
    for bench in data["benchmarks"]:
        if bench.get("aggregate_name") == "median":
            scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[bench["time_unit"]]
            return bench["real_time"] * scale, data["context"]
    fail(f"mha_bench has no benchmark {name} (add the configuration to bench/mha_bench.cpp)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mha-bench", required=True)
    ap.add_argument("--config", action="append", help="B,L,E,H (repeatable; default: the issue's eight)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--ort-dir", default=os.path.expanduser("~/.cache/mha-bench-ort"))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    configs = [tuple(int(x) for x in c.split(",")) for c in args.config] if args.config else ISSUE_CONFIGS

    package = ort_package(args.ort_dir)
    torch = None
    if not args.no_torch:
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        try:
            import torch
        except ImportError as error:
            fail(f"cannot import torch ({error}): run with /usr/bin/python3 (python3-torch), or pass --no-torch")
        torch.set_num_threads(args.threads)
        sys.path.insert(0, HERE)
        from compare_pytorch import TorchSide, reference_blas_error, torch_blas
        blas = torch_blas(torch)
        if reference_blas_error(blas):
            fail(reference_blas_error(blas) + ", or pass --no-torch")

    rows, context = [], {}
    with tempfile.TemporaryDirectory() as work:
        timer = os.path.join(work, "timer.js")
        with open(timer, "w") as f:
            f.write(TIMER_JS)
        for config in configs:
            b, l, e, h = config
            model = os.path.join(work, "model.onnx")
            write_model(model, b, l, e, h)
            side = TorchSide(torch, b, l, e, h, 0) if torch else None
            samples = {"ort": [], "mha": [], "mha_frozen": [], "torch": []}
            for _ in range(args.rounds):
                samples["ort"].append(ort_seconds(package, timer, model, config, args.repeats, args.threads))
                seconds, context = mha_seconds(args.mha_bench, config, args.repeats, args.threads)
                samples["mha"].append(seconds)
                seconds, _ = mha_seconds(args.mha_bench, config, args.repeats, args.threads, "forward_frozen")
                samples["mha_frozen"].append(seconds)
                if side:
                    side.call_seconds()  # warm-up
                    samples["torch"].append(statistics.median(side.call_seconds() for _ in range(args.repeats)))
            row = {"B": b, "L": l, "E": e, "H": h}
            for peer, values in samples.items():
                if values:
                    row[f"{peer}_ms"] = 1e3 * statistics.median(values)
                    row[f"{peer}_gflops"] = flops(b, l, e) / statistics.median(values) * 1e-9
            row["vs_ort"] = row["ort_ms"] / row["mha_ms"]
            row["frozen_vs_ort"] = row["ort_ms"] / row["mha_frozen_ms"]
            if "torch_ms" in row:
                row["vs_torch"] = row["torch_ms"] / row["mha_ms"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)

    meta = {"command": " ".join([sys.executable] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
            "threads": args.threads, "onnxruntime_node": package, "mha_bench_context": context,
            "env": {k: os.environ.get(k, "") for k in ("OPENBLAS_CORETYPE", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")}}
    if torch:
        meta["torch"] = torch.__version__
        meta["torch_blas"] = blas
    print(f"| B, L, E, H | ONNX Runtime ms | mha ms | frozen ms | {'PyTorch ms | ' if torch else ''}"
          f"mha / ORT speed-up | frozen / ORT speed-up | {'mha / PyTorch speed-up | ' if torch else ''}"
          f"mha GFLOP/s | frozen GFLOP/s |")
    print("|---" * (10 if torch else 8) + "|")
    for r in rows:
        torch_cells = f"{r['torch_ms']:.2f} | " if torch else ""
        torch_ratio = f"{r['vs_torch']:.2f} | " if torch else ""
        print(f"| {r['B']}, {r['L']}, {r['E']}, {r['H']} | {r['ort_ms']:.2f} | {r['mha_ms']:.2f} | "
              f"{r['mha_frozen_ms']:.2f} | {torch_cells}{r['vs_ort']:.2f} | {r['frozen_vs_ort']:.2f} | "
              f"{torch_ratio}{r['mha_gflops']:.0f} | {r['mha_frozen_gflops']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
