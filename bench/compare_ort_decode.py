#!/usr/bin/python3
"""Compare one decoding step of mha with ONNX Runtime's GroupQueryAttention decode, alternating them in one run.

Usage (Debian's python3-onnx, so /usr/bin/python3):

    /usr/bin/python3 bench/compare_ort_decode.py --mha-bench build/bench/mha_bench \
        [--config B,H_kv,context ...] [--threads 2] [--rounds 3] [--repeats 5] [--ort-runs 20] \
        [--ort-cache copied|shared|both] [--json out.json]
    /usr/bin/python3 bench/compare_ort_decode.py --mha-bench build/bench/mha_bench --attention-only \
        [--config B,H_kv,context ...] [--ort-cache shared|copied|both] [...]
    /usr/bin/python3 bench/compare_ort_decode.py --check [--threads 2]

Without --config: B in {1, 8} x H_kv in {16, 4, 1} x context 2048 (six configurations). The layer
is mha_bench's `decode`: self-attention with E = 2048, H = 16 query heads of D = 128, H_kv
key/value heads (grouped-query attention), B sequences each holding `context` cached tokens; one
step projects one new token per sequence (W_q [E, E], W_k and W_v [H_kv·D, E], W_o [E, E], with
biases), attends its query to the context + 1 keys, and projects the output.

ONNX Runtime: the npm package onnxruntime-node, found or installed by bench/compare_ort.py's
ort_package ($ORT_NODE, else --ort-dir, default ~/.cache/mha-bench-ort, where it runs `npm install
--ignore-scripts onnxruntime-node@1.30.0`), run by node with a timer this script writes, on a model
this script writes with python3-onnx: inputs x [B, 1, E], past_key and past_value [B, H_kv, T, D]
(BNSH), seqlens_k [B] int32 = context (the op's "total sequence length - 1") and
total_sequence_length, a scalar int32 = context + 1; one MatMul + Add for Q, K and V, Split, the
com.microsoft GroupQueryAttention op (num_heads 16, kv_num_heads H_kv), MatMul + Add for W_O;
outputs y, present_key and present_value (outputs, so that nothing is pruned). Random weights and
biases (numpy, seed 0, standard deviation 0.02). The timer fills x and the cache with random values
once, runs once to warm up, and times --ort-runs calls of session.run on the same inputs: one step
at a fixed context, as mha's rewind makes it. Session options intraOpNumThreads = --threads,
interOpNumThreads 1, all graph optimisations. present_key and present_value are pre-allocated
outputs, so that ONNX Runtime writes them in place and node copies nothing back. --ort-cache:
  copied  T = context, the present cache a second pair of tensors of context + 1 positions: the
          kernel writes the whole past and the new token into it every step (as a model run
          without buffer sharing does);
  shared  T = context + 1, past and present the same tensors: the kernel only writes the new key
          and value at position context (its past_present_share_buffer path, as onnxruntime-genai
          runs it);
  both    (the default) both, in turn, in every round.

mha: `mha_bench --benchmark_filter=^decode/B:<b>/H_kv:<k>/context:<c>$`, --repeats repetitions, the
median aggregate, OMP_NUM_THREADS=--threads.

Each round runs ONNX Runtime and then mha on a configuration; reported per configuration: the
median over all rounds of each one's per-round median, GB/s with the bytes a step must read,
4·(2·E² + 2·H_kv·D·E) of weights and 4·B·2·context·H_kv·D of cache, and mha's speed-up over ONNX
Runtime (> 1: mha is faster).

--attention-only compares the step's attention alone, at sizes whose caches a prompt could not
fill in a benchmark's time: ONNX Runtime's model is the GroupQueryAttention op by itself (inputs
query [B, 1, H·D], key and value [B, 1, H_kv·D] and the caches as above), mha's is
`decode_attention/batched/B:<b>/H_kv:<k>/context:<c>` (the decoding kernel over a cache of
`context` tokens, one new query a sequence; it appends no key). GB/s then counts the cache's bytes,
4·B·2·context·H_kv·D. Without --config: the issue's eighteen decoding targets, B in {1, 8, 32} x
H_kv in {16, 4, 1} x context in {2048, 16384}; --ort-cache defaults to shared there (a copied
cache of B = 32, H_kv = 16, context 16384 would take 16 GiB in ONNX Runtime's process alone). The
timer fills the caches with a cheap pattern instead of random draws: 4 GiB of Math.random() take
minutes.

--check verifies, on small layers (E = 64, H = 4, D = 16) in both cache modes, that ONNX Runtime's
outputs (the GroupQueryAttention output, y and the present cache) agree within 1e-4 with a numpy
(float64) reference of one new query attending to the past keys and its own, and that the shared
cache was updated in place (its cache there has one position more than the step needs, which must
keep its value), then exits.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_ort  # noqa: E402  (its ort_package and benchmark_seconds)

E, H = 2048, 16
DEFAULT_CONFIGS = [(b, k, 2048) for b in (1, 8) for k in (16, 4, 1)]
ATTENTION_CONFIGS = [(b, k, c) for c in (2048, 16384) for b in (1, 8, 32) for k in (16, 4, 1)]
CHECK_CONFIGS = [(2, 64, 4, 2, 5), (1, 64, 4, 1, 7), (2, 64, 4, 4, 3)]  # B, E, H, H_kv, context
TOLERANCE = 1e-4
MODES = ("copied", "shared")

# The timer node runs: the median and minimum seconds of `runs` runs after one warm-up, and the
# outputs' shapes. With an IO directory it reads x, past_key and past_value from <name>.f32 there
# instead of drawing them, runs once, and writes each output to <name>.out.f32 and the cache
# inputs as they are after the run to <name>.after.f32. A model whose inputs are query, key and
# value (the attention alone) gets those instead of x.
TIMER_JS = r"""
const ort = require(process.env.ORT_NODE);
const fs = require('fs');
async function main() {
  const [model, B, E, KV, D, C, T, runs, threads, io] =
      [process.argv[2], ...process.argv.slice(3, 11).map(Number), process.argv[11]];
  const s = await ort.InferenceSession.create(model, {intraOpNumThreads: threads,
    interOpNumThreads: 1, graphOptimizationLevel: 'all', executionMode: 'sequential'});
  const tensor = (name, dims) => {
    let data;
    if (io) {
      const b = fs.readFileSync(`${io}/${name}.f32`);
      data = new Float32Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.length));
    } else {
      data = new Float32Array(dims.reduce((a, n) => a * n, 1));
      for (let i = 0; i < data.length; i++) data[i] = (i * 40503 % 1000) * 1e-3 - 0.5;
    }
    return new ort.Tensor('float32', data, dims);
  };
  const alone = s.inputNames.includes('query');
  const feeds = alone ? {query: tensor('query', [B, 1, E]), key: tensor('key', [B, 1, KV * D]),
                         value: tensor('value', [B, 1, KV * D])}
                      : {x: tensor('x', [B, 1, E])};
  Object.assign(feeds, {past_key: tensor('past_key', [B, KV, T, D]),
                 past_value: tensor('past_value', [B, KV, T, D]),
                 seqlens_k: new ort.Tensor('int32', new Int32Array(B).fill(C), [B]),
                 total_sequence_length: new ort.Tensor('int32', Int32Array.of(C + 1), [])});
  // The present cache is a pre-allocated output (ORT writes into it, the binding copies nothing
  // back): the past's own tensors when it has room for the new token (T > C), else new ones.
  const present = T > C ? [feeds.past_key, feeds.past_value]
      : [0, 1].map(() => new ort.Tensor('float32', new Float32Array(B * KV * (C + 1) * D), [B, KV, C + 1, D]));
  const fetches = Object.fromEntries(s.outputNames.map(name => [name, null]));
  Object.assign(fetches, {present_key: present[0], present_value: present[1]});
  const out = await s.run(feeds, fetches);
  const shapes = Object.fromEntries(s.outputNames.map(name => [name, out[name].dims]));
  if (io) {
    for (const name of s.outputNames) fs.writeFileSync(`${io}/${name}.out.f32`, out[name].data);
    for (const name of ['past_key', 'past_value']) fs.writeFileSync(`${io}/${name}.after.f32`, feeds[name].data);
    console.log(JSON.stringify({shapes}));
    return;
  }
  const ts = [];
  for (let i = 0; i < runs; i++) {
    const t = process.hrtime.bigint();
    await s.run(feeds, fetches);
    ts.push(Number(process.hrtime.bigint() - t) / 1e9);
  }
  ts.sort((a, b) => a - b);
  console.log(JSON.stringify({median: ts[Math.floor(ts.length / 2)], min: ts[0], shapes}));
}
main().catch(e => { console.error(e.message); process.exit(1); });
"""


def fail(message):
    print(f"compare_ort_decode: {message}", file=sys.stderr)
    sys.exit(1)


class OrtFailed(Exception):
    """ONNX Runtime's process failed on a configuration (killed for memory, say)."""


def bytes_read(b, h_kv, context, e=E, h=H, attention_only=False):
    """What a step must read: every weight once (unless attention_only) and the whole cache once,
    in float32."""
    kv = h_kv * (e // h)
    return (0 if attention_only else 4 * (2 * e * e + 2 * kv * e)) + 4 * b * 2 * context * kv


def import_onnx():
    try:
        import onnx
        from onnx import TensorProto, helper
    except ImportError as error:
        fail(f"cannot import onnx ({error}): apt-get install python3-onnx, and run with /usr/bin/python3")
    return onnx, TensorProto, helper


def attention_parts(b, h_kv, query, key, value, e=E, h=H):
    """What both models share: the GroupQueryAttention node on the named query, key and value, the
    cache inputs (past_key, past_value, seqlens_k, total_sequence_length) and the present outputs."""
    _, TensorProto, helper = import_onnx()
    d = e // h
    node = helper.make_node("GroupQueryAttention",
                            [query, key, value, "past_key", "past_value", "seqlens_k", "total_sequence_length"],
                            ["att", "present_key", "present_value"], domain="com.microsoft",
                            num_heads=h, kv_num_heads=h_kv)
    inputs = [helper.make_tensor_value_info("past_key", TensorProto.FLOAT, [b, h_kv, "past_length", d]),
              helper.make_tensor_value_info("past_value", TensorProto.FLOAT, [b, h_kv, "past_length", d]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    # Cache lengths symbolic: the op's shape inference gives present the past's length (as if shared), and
    # ONNX Runtime would refuse a pre-allocated present of context + 1 positions after a past of context.
    outputs = [helper.make_tensor_value_info("present_key", TensorProto.FLOAT, [b, h_kv, "present_length", d]),
               helper.make_tensor_value_info("present_value", TensorProto.FLOAT, [b, h_kv, "present_length", d])]
    return node, inputs, outputs


def save_model(path, nodes, inputs, outputs, inits, name):
    onnx, _, helper = import_onnx()
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    onnx.save(model, path)


def write_model(path, b, h_kv, cache, e=E, h=H, attention_output=False):
    """The decoding step of the module docstring, past_key and past_value of `cache` positions;
    with attention_output, GroupQueryAttention's output is an output too. Returns the weights."""
    import numpy as np
    _, TensorProto, helper = import_onnx()
    from onnx import numpy_helper
    kv = h_kv * (e // h)
    r = np.random.default_rng(0)
    weights = {"w_qkv": r.standard_normal((e, e + 2 * kv)) * 0.02, "b_qkv": r.standard_normal(e + 2 * kv) * 0.02,
               "w_o": r.standard_normal((e, e)) * 0.02, "b_o": r.standard_normal(e) * 0.02}
    weights = {name: value.astype(np.float32) for name, value in weights.items()}
    inits = [numpy_helper.from_array(value, name) for name, value in weights.items()]
    inits.append(numpy_helper.from_array(np.array([e, kv, kv], np.int64), "split"))
    attention, cache_inputs, present = attention_parts(b, h_kv, "q", "k", "v", e, h)
    nodes = [helper.make_node("MatMul", ["x", "w_qkv"], ["qkv0"]),
             helper.make_node("Add", ["qkv0", "b_qkv"], ["qkv"]),
             helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=2),
             attention,
             helper.make_node("MatMul", ["att", "w_o"], ["y0"]),
             helper.make_node("Add", ["y0", "b_o"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, 1, e])] + cache_inputs
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, 1, e])] + present
    if attention_output:
        outputs.append(helper.make_tensor_value_info("att", TensorProto.FLOAT, [b, 1, e]))
    save_model(path, nodes, inputs, outputs, inits, "decode")
    return weights


def write_attention_model(path, b, h_kv, e=E, h=H):
    """The GroupQueryAttention op alone (see --attention-only in the module docstring)."""
    _, TensorProto, helper = import_onnx()
    kv = h_kv * (e // h)
    attention, cache_inputs, present = attention_parts(b, h_kv, "query", "key", "value", e, h)
    inputs = [helper.make_tensor_value_info("query", TensorProto.FLOAT, [b, 1, e]),
              helper.make_tensor_value_info("key", TensorProto.FLOAT, [b, 1, kv]),
              helper.make_tensor_value_info("value", TensorProto.FLOAT, [b, 1, kv])] + cache_inputs
    outputs = [helper.make_tensor_value_info("att", TensorProto.FLOAT, [b, 1, e])] + present
    save_model(path, [attention], inputs, outputs, [], "decode_attention")


def run_timer(package, timer, model, sizes, runs, threads, io=None):
    """The timer's JSON for sizes (B, E, H_kv, D, context, cache positions)."""
    command = ["node", timer, model] + [str(n) for n in sizes] + [str(runs), str(threads)] + ([io] if io else [])
    out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "ORT_NODE": package})
    if out.returncode != 0:
        how = f"killed by signal {-out.returncode}" if out.returncode < 0 else f"exit code {out.returncode}"
        raise OrtFailed(f"ONNX Runtime's process failed ({how}): {out.stderr.strip() or 'no message'}")
    return json.loads(out.stdout)


def reference(weights, x, past_key, past_value, context, h, h_kv):
    """One decoding step in float64 numpy: the attention output, y, and the keys and values it attends to."""
    import numpy as np
    w = {name: value.astype(np.float64) for name, value in weights.items()}
    b, _, e = x.shape
    d = e // h
    qkv = x.astype(np.float64)[:, 0] @ w["w_qkv"] + w["b_qkv"]
    q = qkv[:, :e].reshape(b, h, d)
    k_new = qkv[:, e:e + h_kv * d].reshape(b, h_kv, 1, d)
    v_new = qkv[:, e + h_kv * d:].reshape(b, h_kv, 1, d)
    keys = np.concatenate([past_key[:, :, :context], k_new], axis=2)  # [B, H_kv, context + 1, D]
    values = np.concatenate([past_value[:, :, :context], v_new], axis=2)
    group = h // h_kv
    att = np.empty((b, h, d))
    for head in range(h):
        scores = np.einsum("bd,btd->bt", q[:, head], keys[:, head // group]) / np.sqrt(d)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        att[:, head] = np.einsum("bt,btd->bd", p, values[:, head // group])
    att = att.reshape(b, 1, e)
    return {"att": att, "y": att @ w["w_o"] + w["b_o"], "keys": keys, "values": values}


def check(package, timer, work, threads):
    """Compares ONNX Runtime with reference() on CHECK_CONFIGS in both cache modes; False if any differs."""
    import numpy as np
    ok = True
    r = np.random.default_rng(1)
    for b, e, h, h_kv, context in CHECK_CONFIGS:
        d = e // h
        for mode in MODES:
            cache = context if mode == "copied" else context + 2  # shared: one spare position, untouched
            model = os.path.join(work, "check.onnx")
            weights = write_model(model, b, h_kv, cache, e, h, attention_output=True)
            inputs = {"x": r.standard_normal((b, 1, e)), "past_key": r.standard_normal((b, h_kv, cache, d)),
                      "past_value": r.standard_normal((b, h_kv, cache, d))}
            inputs = {name: value.astype(np.float32) for name, value in inputs.items()}
            for name, value in inputs.items():
                value.tofile(os.path.join(work, f"{name}.f32"))
            shapes = run_timer(package, timer, model, (b, e, h_kv, d, context, cache), 1, threads, work)["shapes"]
            ref = reference(weights, inputs["x"], inputs["past_key"], inputs["past_value"], context, h, h_kv)
            # What the timer wrote (file name: expected value).
            want = {"att.out": ref["att"], "y.out": ref["y"]}
            for name, new in (("key", ref["keys"]), ("value", ref["values"])):
                if mode == "copied":  # a new present of context + 1 positions; the past untouched
                    want[f"present_{name}.out"] = new
                    want[f"past_{name}.after"] = inputs[f"past_{name}"]
                else:  # present is the past, the new token written at position context, the rest kept
                    updated = inputs[f"past_{name}"].astype(np.float64)
                    updated[:, :, :context + 1] = new
                    want[f"present_{name}.out"] = want[f"past_{name}.after"] = updated
            errors = {}
            for name, value in want.items():
                got = np.fromfile(os.path.join(work, f"{name}.f32"), np.float32)
                shape = list(shapes.get(name.replace(".out", ""), value.shape))
                if shape != list(value.shape) or got.size != value.size:
                    fail(f"ONNX Runtime's {name}: shape {shape}, {got.size} values; the reference's {value.shape}")
                errors[name] = float(np.abs(got.reshape(value.shape) - value).max())
            passed = max(errors.values()) <= TOLERANCE
            ok &= passed
            print(f"check B={b} E={e} H={h} H_kv={h_kv} context={context} {mode} cache of {cache}: "
                  f"{'ok' if passed else 'FAILED'}, max |ORT - numpy| "
                  + ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
                  + "; ORT shapes " + ", ".join(f"{name} {shape}" for name, shape in shapes.items()))
    return ok


def ort_seconds(package, timer, model, config, cache, runs, threads):
    """ONNX Runtime's median seconds of a step, and its outputs' shapes (y, or the attention alone's
    att, checked against [B, 1, E])."""
    b, h_kv, context = config
    result = run_timer(package, timer, model, (b, E, h_kv, E // H, context, cache), runs, threads)
    output = "y" if "y" in result["shapes"] else "att"
    if list(result["shapes"][output]) != [b, 1, E]:
        fail(f"ONNX Runtime's {output} has shape {result['shapes'][output]}, not {[b, 1, E]}")
    return result["median"], result["shapes"]


def mha_seconds(binary, config, repeats, threads, attention_only=False):
    """mha_bench's median seconds of decode/B:<b>/H_kv:<k>/context:<c> (or, attention_only,
    decode_attention/batched/...), and its context."""
    b, h_kv, context = config
    name = "decode_attention/batched" if attention_only else "decode"
    return compare_ort.benchmark_seconds(binary, f"{name}/B:{b}/H_kv:{h_kv}/context:{context}",
                                         repeats, threads)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mha-bench", help="the mha_bench binary (required unless --check)")
    ap.add_argument("--config", action="append",
                    help="B,H_kv,context (repeatable; default: B 1 and 8, H_kv 16, 4 and 1, context 2048; "
                         "with --attention-only the eighteen of the module docstring)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="mha_bench's repetitions per round")
    ap.add_argument("--ort-runs", type=int, default=20, help="timed session.run calls per round")
    ap.add_argument("--ort-cache", choices=MODES + ("both",),
                    help="default: both, or shared with --attention-only")
    ap.add_argument("--attention-only", action="store_true",
                    help="the attention alone: GroupQueryAttention against decode_attention/batched")
    ap.add_argument("--check", action="store_true", help="verify ONNX Runtime's step against numpy, then exit")
    ap.add_argument("--ort-dir", default=os.path.expanduser("~/.cache/mha-bench-ort"))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not args.check and not args.mha_bench:
        ap.error("--mha-bench is required (unless --check)")
    alone = args.attention_only
    default_configs = ATTENTION_CONFIGS if alone else DEFAULT_CONFIGS
    configs = [tuple(int(x) for x in c.split(",")) for c in args.config] if args.config else default_configs
    ort_cache = args.ort_cache or ("shared" if alone else "both")
    modes = MODES if ort_cache == "both" else (ort_cache,)

    package = compare_ort.ort_package(args.ort_dir)
    rows, context = [], {}
    with tempfile.TemporaryDirectory() as work:
        timer = os.path.join(work, "timer.js")
        with open(timer, "w") as f:
            f.write(TIMER_JS)
        if args.check:
            try:
                return 0 if check(package, timer, work, args.threads) else 1
            except OrtFailed as error:
                fail(str(error))
        for config in configs:
            b, h_kv, c = config
            models = {}
            for mode in modes:
                models[mode] = os.path.join(work, f"{mode}.onnx")
                if alone:
                    write_attention_model(models[mode], b, h_kv)
                else:
                    write_model(models[mode], b, h_kv, c if mode == "copied" else c + 1)
            samples = {f"ort_{mode}": [] for mode in modes}
            samples["mha"] = []
            shapes, ort_error = None, None
            for _ in range(args.rounds):
                for mode in modes:
                    if ort_error:
                        continue
                    # A configuration ONNX Runtime cannot run (its process killed for want of
                    # memory) is recorded as such, mha's side still measured.
                    try:
                        seconds, shapes = ort_seconds(package, timer, models[mode], config,
                                                      c if mode == "copied" else c + 1, args.ort_runs,
                                                      args.threads)
                    except OrtFailed as error:
                        ort_error = f"{mode}: {error}"
                        continue
                    samples[f"ort_{mode}"].append(seconds)
                seconds, context = mha_seconds(args.mha_bench, config, args.repeats, args.threads, alone)
                samples["mha"].append(seconds)
            read = bytes_read(b, h_kv, c, attention_only=alone)
            row = {"B": b, "H_kv": h_kv, "context": c, "MiB_read": read / 2 ** 20, "ort_output_shapes": shapes}
            if ort_error:
                row["ort_error"] = ort_error
            for peer, values in samples.items():
                if values:
                    row[f"{peer}_ms"] = 1e3 * statistics.median(values)
                    row[f"{peer}_GBps"] = read / statistics.median(values) * 1e-9
            for mode in modes:
                if f"ort_{mode}_ms" in row:
                    row[f"vs_ort_{mode}"] = row[f"ort_{mode}_ms"] / row["mha_ms"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)

    meta = {"command": " ".join([sys.executable] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
            "threads": args.threads, "rounds": args.rounds, "repeats": args.repeats, "ort_runs": args.ort_runs,
            "ort_cache": list(modes), "attention_only": alone, "onnxruntime_node": package, "mha_bench_context": context,
            "env": {k: os.environ.get(k, "") for k in ("OPENBLAS_CORETYPE", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")}}
    header = (["B, H_kv, context", "MiB read"] + [f"ONNX Runtime {mode} ms" for mode in modes] + ["mha ms"]
              + [f"ONNX Runtime {mode} GB/s" for mode in modes] + ["mha GB/s"]
              + [f"mha / ORT {mode} speed-up" for mode in modes])
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    def cell(row, key, spec):
        return format(row[key], spec) if key in row else "failed"

    for r in rows:
        cells = ([f"{r['B']}, {r['H_kv']}, {r['context']}", f"{r['MiB_read']:.0f}"]
                 + [cell(r, f"ort_{mode}_ms", ".2f") for mode in modes] + [f"{r['mha_ms']:.2f}"]
                 + [cell(r, f"ort_{mode}_GBps", ".1f") for mode in modes] + [f"{r['mha_GBps']:.1f}"]
                 + [cell(r, f"vs_ort_{mode}", ".2f") for mode in modes])
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        if "ort_error" in r:
            print(f"B = {r['B']}, H_kv = {r['H_kv']}, context {r['context']}: {r['ort_error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
