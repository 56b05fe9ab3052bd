#!/usr/bin/python3
"""Compare mha's forward pass, or its training step, with PyTorch's nn.MultiheadAttention,
alternating the two in one run.

Usage (Debian's python3-torch, so /usr/bin/python3, not the python3 first on PATH):

    /usr/bin/python3 bench/compare_pytorch.py --mha-bench build/bench/mha_bench \
        [--mode forward|train] [--threads 2] [--kernel auto] [--sweep heads|length|default] \
        [--repeats 5] [--rounds 2] [--json out.json] [--max-seconds-per-config 20] \
        [--max-length N] [--config B,L,E,H ...] [--no-torch-memory] \
        [--max-foreign-load 0.1] [--retries N] [--busy-pause 60] \
        [--mha-prefix forward_bf16] [--torch-autocast none|bf16]

Sweeps (self-attention, L = S):
    default  (B,L,E,H) = (1,128,768,12) (8,128,512,8) (1,1024,512,8) (1,2048,512,8) (1,4096,512,8)
    heads    B=1, E in {512,768,1024}, H in {1,2,4,8,12,16,32,64} dividing E, L in {128,512,2048}
    length   B=1, E=512, H=8, L in {128,256,...,16384}
--config B,L,E,H (repeatable) replaces the sweep; --max-length drops configurations with a longer L.

For each configuration, in --rounds rounds, alternately (so both sides see the same machine load):
  * torch, --mode forward (the default): nn.MultiheadAttention(E, H, batch_first=True).eval(),
    torch.inference_mode(), need_weights=False, fp32 randn input (x, x, x).
    --torch-autocast bf16: the same layer's forward under torch.autocast("cpu",
    dtype=torch.bfloat16) and no_grad, in train mode with dropout 0, since torch 1.13's
    inference fast path fails under CPU autocast; its products then run in bf16.
    --mode train: the same layer in train mode (dropout 0), x requiring grad, a fixed randn
    grad_output g; one call is `out, _ = layer(x, x, x, need_weights=False); out.backward(g)`,
    and the gradients are zeroed before each call, outside the timing, keeping their buffers
    (zero_grad(set_to_none=False), x.grad.zero_()) so that backward adds into them, as mha's does.
    Both modes: torch.set_num_threads(threads); one warm-up call (timed: it drives the
    --max-seconds-per-config guard), then --repeats timed calls per round. Reported: the median of
    all timed calls.
  * mha: `mha_bench --benchmark_filter=^<mode>/<kernel>/B:<b>/L:<l>/E:<e>/H:<h>$
    --benchmark_repetitions=<repeats> --benchmark_report_aggregates_only=true
    --benchmark_format=json` in a child with OMP_NUM_THREADS=<threads>; --mha-prefix replaces
    <mode> in the name (forward_bf16 for Precision::bf16, forward_bf16_frozen). Reported: the median over
    rounds of the "median" aggregate's real_time. train/<kernel> times forward_train + backward
    with zero_grad outside the timing (see bench/mha_bench.cpp).
GFLOP/s use FLOPs = B·(8·L·E² + 4·L²·E) on both sides, three times that in train mode (the usual
forward + backward count; mha's backward also recomputes the scores, see mha_bench.cpp), and
mha_bench's own GFLOPS counter is kept in the JSON as mha_bench_gflops. ratio = torch ms / mha
ms, so > 1 means mha is faster.

Memory, in train mode: mha's is mha_bench's peak_extra_MiB counter (the heap one step held above
what existed before it, every malloc counted; outputs and input gradients included, parameter
gradients not). torch's is measured once per configuration after the timed rounds (so the
profiler cannot disturb them), on one more step under torch.profiler with profile_memory=True:
the most bytes torch's CPU tensor allocator held during the step beyond what it held before,
from the profiler's allocation records. That sees every tensor (the output, autograd's saved
tensors, the temporaries, the input's new gradient) but not memory torch's libraries allocate
outside its allocator (OpenBLAS's buffers, the autograd graph), so it is a lower bound on torch's
heap growth. getrusage's maxrss is a process-wide high-water mark (it cannot go down between
configurations) and tracemalloc does not see torch's allocator, hence the profiler.
--no-torch-memory skips it; forward mode does not measure memory.

Thread control on the torch side: Debian's torch 1.13 runs its GEMMs in OpenBLAS (pthreads build),
which ignores torch.set_num_threads and starts one thread per CPU, and its OpenMP threads spin
between parallel regions and fight OpenBLAS's threads for the cores (measured here: B=1 L=128
E=768 H=12 took 48 ms with 2 threads against 7 ms with 1). So before importing torch this script
sets, in its own process only, OPENBLAS_NUM_THREADS=<threads> and OMP_WAIT_POLICY=PASSIVE
(--torch-omp-wait-policy; pass "" to leave it unset). The mha_bench child gets the caller's
environment plus OMP_NUM_THREADS=<threads> and any --mha-env KEY=VALUE.

Guards, so that a sweep stays bounded on a shared machine:
  * torch memory: peak estimated as B·H·L²·4 bytes·2 (the score matrix and its softmax), ·3 in
    train mode (the saved softmax, its gradient and the scores' gradient, as measured); the torch
    side is skipped when that exceeds half of MemAvailable (/proc/meminfo, read per configuration).
  * time: the torch side is skipped when its warm-up call exceeds --max-seconds-per-config, or when
    a previous configuration with the same (B, E, H) and a shorter L predicts (scaled by FLOPs) a
    call longer than that; the mha side is skipped on the same prediction and each mha_bench child
    is killed after --repeats·(max-seconds + 5) + 60 s.
  * mha memory: the child's address space is limited to --mha-mem-fraction (0.75) of MemAvailable,
    so a runaway allocation fails in the child instead of pushing the machine into the OOM killer.
  * other processes: each row records foreign_load, the CPUs that other processes used on
    average while its sides were timed (busy time in /proc/stat less this process's and its
    children's CPU time); above --max-foreign-load the status says so, and with --retries N the
    configuration is measured again up to N times, keeping the attempt with the least foreign
    load. With --retries, each attempt first waits, up to --busy-pause seconds, for a 5-second
    window in which other processes stay under --max-foreign-load.
The mha side of a torch-skipped configuration is still measured (that is where a tiled kernel's
advantage shows), and torch is still measured when mha_bench does not register the configuration
(status "not registered"; --skip-unregistered skips such configurations entirely).

Output: a table (one row per configuration, printed as each finishes) and a final line with the
command line and the machine; --json writes {"meta": ..., "rows": [...]} after every row, for
bench/plot.py (which charts forward-mode files). Exit status: 0 when every configuration was measured or deliberately skipped;
1 when a measurement failed (mha_bench crashed or timed out, torch raised); 2 on setup errors
(mha_bench missing or not executable, torch not importable, bad arguments); 130 on Ctrl-C.
"""
import argparse
import datetime
import gc
import json
import math
import os
import platform
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time

DEFAULT_CONFIGS = [(1, 128, 768, 12), (8, 128, 512, 8), (1, 1024, 512, 8), (1, 2048, 512, 8),
                   (1, 4096, 512, 8)]
HEADS = [1, 2, 4, 8, 12, 16, 32, 64]
TIME_UNIT_TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def sweep_configs(sweep):
    if sweep == "default":
        return list(DEFAULT_CONFIGS)
    if sweep == "heads":
        return [(1, l, e, h) for e in (512, 768, 1024) for l in (128, 512, 2048) for h in HEADS
                if e % h == 0]
    if sweep == "length":
        return [(1, 128 << i, 512, 8) for i in range(8)]  # 128 ... 16384
    raise ValueError(sweep)


def flops(b, l, e):
    return b * (8 * l * e * e + 4 * l * l * e)


def step_flops(mode, b, l, e):
    """A forward's FLOPs, or a training step's: three times the forward's."""
    return (3 if mode == "train" else 1) * flops(b, l, e)


def bench_name(mode, kernel, b, l, e, h):
    return f"{mode}/{kernel}/B:{b}/L:{l}/E:{e}/H:{h}"


class SetupError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Machine description


def mem_available_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def torch_blas(torch):
    """The library that provides sgemm_ to torch in this process (a path), after one product.

    Debian's python3-torch calls the system's libblas.so.3, which is whatever the alternatives
    system points it at; on a machine without libopenblas0 that is the reference BLAS, about 30
    times slower than OpenBLAS (on 2026-12-04 torch's forward ran at 3 GFLOP/s on it), which
    makes any comparison with torch meaningless. Which library a call reaches is what the
    dynamic linker resolves sgemm_ to, asked of it with dladdr; the libraries mapped are not
    enough (OpenBLAS's LAPACK can be loaded beside the reference BLAS)."""
    import ctypes

    torch.ones(64, 64) @ torch.ones(64, 64)

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    # dlsym through torch's own library's handle searches the libraries it depends on, in the
    # order that resolved its calls (the process's global scope does not hold them: Python
    # loads extensions RTLD_LOCAL).
    with open("/proc/self/maps") as f:
        libraries = [line.split()[-1] for line in f if "libtorch_cpu" in line]
    if not libraries:
        return "no libtorch_cpu in this process"
    try:
        sgemm = ctypes.cast(ctypes.CDLL(libraries[0]).sgemm_, ctypes.c_void_p)
    except AttributeError:
        return "no sgemm_ reachable from " + libraries[0]
    info = DlInfo()
    libc = ctypes.CDLL("libc.so.6")
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    if libc.dladdr(sgemm, ctypes.byref(info)) == 0 or not info.dli_fname:
        return "sgemm_ from an unknown library"
    return os.path.realpath(info.dli_fname.decode())


def reference_blas_error(blas):
    """An error message when torch's products would run on the reference BLAS, else None. (A
    sgemm_ inside libtorch_cpu itself is the MKL that PyPI's wheels link in statically.)"""
    if re.search(r"openblas|mkl|blis|libtorch_cpu", blas):
        return None
    return (f"torch's sgemm_ is {blas}, not a tuned BLAS; install OpenBLAS: "
            f"apt-get install libopenblas0-pthread")


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env=dict(os.environ, LC_ALL="C")).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def busy_cpu_seconds():
    """CPU seconds that all processes have used since boot (user, nice, system, irq, softirq),
    from /proc/stat; None when it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _, _, irq, softirq = (int(v) for v in fields[1:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    """CPU seconds of this process (every thread) and of the children it has waited for."""
    return sum(usage.ru_utime + usage.ru_stime for usage in
               (resource.getrusage(resource.RUSAGE_SELF),
                resource.getrusage(resource.RUSAGE_CHILDREN)))


class ForeignLoad:
    """The CPUs that other processes use on average from construction to value()."""

    def __init__(self):
        self.start = (time.monotonic(), busy_cpu_seconds(), own_cpu_seconds())

    def value(self):
        wall_start, busy_start, own_start = self.start
        busy, wall = busy_cpu_seconds(), time.monotonic() - wall_start
        if busy is None or busy_start is None or wall <= 0:
            return None
        return max(0.0, (busy - busy_start - (own_cpu_seconds() - own_start)) / wall)


def wait_for_idle(max_load, timeout, window=5.0):
    """Waits until other processes use at most max_load CPUs over a window, or timeout seconds.
    Returns the last window's load (None when /proc/stat cannot be read)."""
    deadline = time.monotonic() + timeout
    while True:
        load = ForeignLoad()
        time.sleep(window)
        value = load.value()
        if value is None or value <= max_load or time.monotonic() >= deadline:
            return value


def nproc():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 0


# ---------------------------------------------------------------------------------------------
# mha_bench side


class MhaBench:
    def __init__(self, path, threads, extra_args, extra_env, mem_fraction):
        self.path = path
        self.extra_args = list(extra_args)
        self.mem_fraction = mem_fraction
        self.env = dict(os.environ)  # snapshot before this script changes its own environment
        self.env.update(extra_env)
        self.env["OMP_NUM_THREADS"] = str(threads)
        self.context = None
        if not os.path.exists(path):
            raise SetupError(f"mha_bench not found: {path!r} (build it with: cmake -S . -B build "
                             f"&& cmake --build build --target mha_bench -j2)")
        if not os.path.isfile(path) or not os.access(path, os.X_OK):
            raise SetupError(f"mha_bench is not an executable file: {path!r}")
        try:
            proc = subprocess.run([path, "--benchmark_list_tests"], capture_output=True, text=True,
                                  timeout=120, env=self.env)
        except (OSError, subprocess.SubprocessError) as error:
            raise SetupError(f"cannot run {path!r}: {error}") from error
        if proc.returncode != 0:
            raise SetupError(f"{path} --benchmark_list_tests exited with {proc.returncode}: "
                             f"{proc.stderr.strip()[-500:]}")
        self.registered = set(proc.stdout.split())

    def _limit_memory(self, pid):
        # Set from the parent right after the start (prlimit), not in a preexec_fn: this process
        # has torch's threads, and running Python between fork and exec is unsafe then. The child
        # allocates its tensors well after this point.
        available = mem_available_bytes()
        if self.mem_fraction > 0 and available:
            limit = int(available * self.mem_fraction)
            try:
                resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))
            except (OSError, ValueError):
                pass  # the child already exited, or the limit is not allowed: run unlimited

    def run(self, name, repeats, timeout):
        """One mha_bench child for one benchmark. Returns a dict with status "ok" (and ms, gflops,
        peak_mib), "not registered", "timeout" or "failed" (and detail)."""
        command = [self.path, f"--benchmark_filter=^{name}$", f"--benchmark_repetitions={repeats}",
                   "--benchmark_report_aggregates_only=true", "--benchmark_format=json",
                   *self.extra_args]
        try:
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=self.env, start_new_session=True)
        except OSError as error:
            return {"status": "failed", "detail": f"cannot run mha_bench: {error}"}
        self._limit_memory(proc.pid)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own process group: nothing else
            except OSError:
                proc.kill()
            proc.communicate()
            return {"status": "timeout", "detail": f"mha_bench killed after {timeout:.0f} s"}
        except KeyboardInterrupt:  # the child is in its own session and did not get the SIGINT
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            raise
        stderr = stderr.strip()
        if proc.returncode != 0:
            how = (f"signal {-proc.returncode}" if proc.returncode < 0
                   else f"exit {proc.returncode}")
            return {"status": "failed", "detail": f"mha_bench {how}: {stderr[-300:]}"}
        if "Failed to match any benchmarks" in stderr or not stdout.strip():
            return {"status": "not registered", "detail": f"no benchmark matches ^{name}$"}
        try:
            report = json.loads(stdout[stdout.index("{"):])
        except ValueError as error:
            return {"status": "failed", "detail": f"unparsable mha_bench JSON: {error}"}
        if self.context is None:
            self.context = report.get("context")
        entries = [entry for entry in report.get("benchmarks", [])
                   if entry.get("run_name", entry.get("name")) == name
                   and entry.get("error_occurred") is not True]
        errors = [entry.get("error_message") for entry in report.get("benchmarks", [])
                  if entry.get("error_occurred")]
        if errors:
            return {"status": "failed", "detail": f"benchmark error: {errors[0]}"}
        if not entries:
            return {"status": "not registered", "detail": f"no benchmark named {name} in output"}
        medians = [entry for entry in entries if entry.get("run_type") == "aggregate"
                   and entry.get("aggregate_name") == "median"]
        if medians:  # the usual case
            chosen = medians[0]
            ms = chosen["real_time"] * TIME_UNIT_TO_MS[chosen.get("time_unit", "ns")]
            gflops = chosen.get("GFLOPS")
            peak_mib = chosen.get("peak_extra_MiB")
        else:  # --benchmark_repetitions=1 reports the single run, no aggregates
            runs = [entry for entry in entries if entry.get("run_type", "iteration") == "iteration"]
            if not runs:
                return {"status": "failed", "detail": "no median aggregate and no runs in output"}
            ms = statistics.median(entry["real_time"] * TIME_UNIT_TO_MS[entry.get("time_unit", "ns")]
                                   for entry in runs)
            gflops = statistics.median(entry.get("GFLOPS", math.nan) for entry in runs)
            peak_mib = statistics.median(entry.get("peak_extra_MiB", math.nan) for entry in runs)
        return {"status": "ok", "ms": ms, "gflops": gflops, "peak_mib": peak_mib}


# ---------------------------------------------------------------------------------------------
# torch side


class TorchSide:
    def __init__(self, torch, b, l, e, h, seed, autocast="none"):
        self.torch = torch
        self.autocast = autocast
        torch.manual_seed(seed)
        self.layer = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
        if autocast == "bf16":
            # torch 1.13's inference fast path (torch._native_multi_head_attention) fails under CPU
            # autocast ("expected scalar type BFloat16 but found Float"); the layer in train mode
            # with dropout 0 under no_grad takes the composite path, which autocast runs in bf16.
            self.layer.train()
        self.x = torch.randn(b, l, e, dtype=torch.float32)

    def call_seconds(self):
        torch = self.torch
        if self.autocast == "bf16":
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                start = time.perf_counter()
                out, _ = self.layer(self.x, self.x, self.x, need_weights=False)
                elapsed = time.perf_counter() - start
        else:
            with torch.inference_mode():
                start = time.perf_counter()
                out, _ = self.layer(self.x, self.x, self.x, need_weights=False)
                elapsed = time.perf_counter() - start
        del out
        return elapsed


class TorchTrainSide:
    """One training step: the forward in train mode (dropout 0), then the backward of a fixed
    grad_output into the parameters' and the input's gradients."""

    def __init__(self, torch, b, l, e, h, seed):
        self.torch = torch
        torch.manual_seed(seed)
        self.layer = torch.nn.MultiheadAttention(e, h, batch_first=True).train()
        self.x = torch.randn(b, l, e, dtype=torch.float32, requires_grad=True)
        self.grad_output = torch.randn(b, l, e, dtype=torch.float32)

    def zero_grad(self):
        # Keeps the gradient buffers, so that backward adds into them as mha's backward does.
        self.layer.zero_grad(set_to_none=False)
        if self.x.grad is not None:
            self.x.grad.zero_()

    def step(self):
        out, _ = self.layer(self.x, self.x, self.x, need_weights=False)
        out.backward(self.grad_output)
        return out

    def call_seconds(self):
        self.zero_grad()
        start = time.perf_counter()
        out = self.step()
        elapsed = time.perf_counter() - start
        del out
        return elapsed

    def peak_bytes(self):
        """The most bytes torch's CPU allocator held during one step beyond what it held before,
        from torch.profiler's allocation records; None when this torch does not expose them."""
        from torch.profiler import ProfilerActivity, profile
        self.zero_grad()
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = self.step()
            del out
        try:  # torch 1.13's record tree; allocation records carry alloc_size (< 0 for a free)
            roots = prof.profiler.kineto_results.experimental_event_tree()
        except AttributeError:
            return None
        allocations, pending = [], list(roots)
        while pending:
            node = pending.pop()
            pending.extend(node.children)
            if hasattr(node.extra_fields, "alloc_size"):
                allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
        if not allocations:
            return None
        in_use = peak = 0
        for _, size in sorted(allocations):
            in_use += size
            peak = max(peak, in_use)
        return peak


# ---------------------------------------------------------------------------------------------


def parse_config(text):
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 4 or min(values) <= 0 or values[2] % values[3] != 0:
        raise argparse.ArgumentTypeError(f"expected B,L,E,H with H dividing E, got {text!r}")
    return values


def parse_env(text):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return tuple(text.split("=", 1))


def fmt(value, spec):
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


COLUMNS = [("config", 30, "<"), ("torch ms", 10, ">"), ("mha ms", 10, ">"), ("torch/mha", 9, ">"),
           ("torch GF/s", 10, ">"), ("mha GF/s", 9, ">"), ("status", 0, "<")]
# Train mode adds each side's peak memory per step, before the status.
TRAIN_COLUMNS = COLUMNS[:-1] + [("torch MiB", 9, ">"), ("mha MiB", 8, ">"), COLUMNS[-1]]


def table_line(cells, columns):
    return "  ".join(format(cell, f"{align}{width}") if width else cell
                     for cell, (_, width, align) in zip(cells, columns)).rstrip()


def row_cells(row, mode):
    config = f"B:{row['B']}/L:{row['L']}/E:{row['E']}/H:{row['H']}"
    cells = [config, fmt(row["torch_ms"], ".2f"), fmt(row["mha_ms"], ".2f"),
             fmt(row["ratio"], ".2f"), fmt(row["torch_gflops"], ".1f"),
             fmt(row["mha_gflops"], ".1f")]
    if mode == "train":
        cells += [fmt(row["torch_peak_mib"], ".1f"), fmt(row["mha_peak_mib"], ".1f")]
    return cells + [row["status"]]


def write_json(path, meta, rows):
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
        f.write("\n")
    os.replace(temporary, path)


def predicted_seconds(history, b, l, e, h):
    """Per-call seconds predicted from the longest shorter-L config measured with the same B, E, H,
    scaled by FLOPs; None when there is none."""
    previous = [(pl, seconds) for (pb, pl, pe, ph), seconds in history.items()
                if (pb, pe, ph) == (b, e, h) and pl < l]
    if not previous:
        return None
    pl, seconds = max(previous)
    return seconds * flops(b, l, e) / flops(b, pl, e)


def measure(args, config, bench, torch, history):
    b, l, e, h = config
    train = args.mode == "train"
    name = bench_name(args.mha_prefix or args.mode, args.kernel, b, l, e, h)
    row = {"B": b, "L": l, "E": e, "H": h, "flops": step_flops(args.mode, b, l, e),
           "benchmark": name, "torch_ms": None, "mha_ms": None, "ratio": None,
           "torch_gflops": None, "mha_gflops": None, "mha_bench_gflops": None,
           "torch_peak_mib": None, "mha_peak_mib": None, "torch_samples_ms": [],
           "mha_round_medians_ms": [], "torch_status": "pending", "mha_status": "pending",
           "torch_detail": "", "mha_detail": "", "foreign_load": None}

    registered = name in bench.registered
    if not registered:
        row["mha_status"], row["mha_detail"] = "not registered", f"{name} is not in --benchmark_list_tests"
        if args.skip_unregistered:
            row["torch_status"], row["torch_detail"] = "skipped", "mha config not registered"

    # Torch guards, decided before building anything.
    torch_side = None
    if row["torch_status"] == "pending":
        available = mem_available_bytes()
        peak = b * h * l * l * 4 * (3 if train else 2)
        guess = predicted_seconds(history["torch"], b, l, e, h)
        if available is not None and peak > available / 2:
            row["torch_status"] = "skipped (memory)"
            row["torch_detail"] = (f"estimated peak {peak / 2**30:.1f} GiB > {available / 2**31:.1f}"
                                   f" GiB, half of MemAvailable")
        elif guess is not None and guess > args.max_seconds_per_config:
            row["torch_status"] = "skipped (time)"
            row["torch_detail"] = (f"predicted {guess:.1f} s per call > "
                                   f"{args.max_seconds_per_config:g} s")
        else:
            try:
                if train:
                    torch_side = TorchTrainSide(torch, b, l, e, h, args.seed)
                else:
                    torch_side = TorchSide(torch, b, l, e, h, args.seed, args.torch_autocast)
                warmup = torch_side.call_seconds()
                if warmup > args.max_seconds_per_config:
                    row["torch_status"] = "skipped (time)"
                    row["torch_detail"] = (f"warm-up call took {warmup:.1f} s > "
                                           f"{args.max_seconds_per_config:g} s")
                    torch_side = None
            except (RuntimeError, MemoryError) as error:
                row["torch_status"], row["torch_detail"] = "error", str(error)[:300]
                torch_side = None

    if row["mha_status"] == "pending":
        guess = predicted_seconds(history["mha"], b, l, e, h)
        if guess is not None and guess > args.max_seconds_per_config:
            row["mha_status"] = "skipped (time)"
            row["mha_detail"] = (f"predicted {guess:.1f} s per call > "
                                 f"{args.max_seconds_per_config:g} s")

    mha_timeout = args.repeats * (args.max_seconds_per_config + 5) + 60
    mha_gflops, mha_peaks = [], []
    load = ForeignLoad()
    for _ in range(args.rounds):
        if torch_side is not None:
            try:
                for _ in range(args.repeats):
                    row["torch_samples_ms"].append(torch_side.call_seconds() * 1e3)
            except (RuntimeError, MemoryError) as error:
                row["torch_status"], row["torch_detail"] = "error", str(error)[:300]
                torch_side = None
            time.sleep(args.pause)  # let torch's worker threads go idle before the child starts
        if row["mha_status"] == "pending":
            result = bench.run(name, args.repeats, mha_timeout)
            if result["status"] == "ok":
                row["mha_round_medians_ms"].append(result["ms"])
                mha_gflops.append(result["gflops"])
                mha_peaks.append(result["peak_mib"])
            else:
                row["mha_status"], row["mha_detail"] = result["status"], result["detail"]
            time.sleep(args.pause)
    row["foreign_load"] = load.value()
    if train and args.torch_memory and torch_side is not None:
        try:
            peak = torch_side.peak_bytes()
            row["torch_peak_mib"] = None if peak is None else peak / 2**20
        except (RuntimeError, MemoryError) as error:
            row["torch_detail"] = f"memory not measured: {str(error)[:200]}"
    del torch_side
    gc.collect()

    if row["torch_samples_ms"] and row["torch_status"] == "pending":
        row["torch_status"] = "ok"
        row["torch_ms"] = statistics.median(row["torch_samples_ms"])
        row["torch_gflops"] = row["flops"] / (row["torch_ms"] * 1e-3) * 1e-9
        history["torch"][config] = row["torch_ms"] * 1e-3
    if row["mha_round_medians_ms"] and row["mha_status"] == "pending":
        row["mha_status"] = "ok"
        row["mha_ms"] = statistics.median(row["mha_round_medians_ms"])
        row["mha_gflops"] = row["flops"] / (row["mha_ms"] * 1e-3) * 1e-9
        counters = [g for g in mha_gflops if g is not None and not math.isnan(g)]
        row["mha_bench_gflops"] = statistics.median(counters) if counters else None
        peaks = [p for p in mha_peaks if p is not None and not math.isnan(p)]
        row["mha_peak_mib"] = statistics.median(peaks) if peaks else None
        history["mha"][config] = row["mha_ms"] * 1e-3
    if row["torch_ms"] and row["mha_ms"]:
        row["ratio"] = row["torch_ms"] / row["mha_ms"]

    notes = []
    for side in ("torch", "mha"):
        status, detail = row[f"{side}_status"], row[f"{side}_detail"]
        if status != "ok":
            notes.append(f"{side}: {status}" + (f" ({detail})" if detail and status != "not registered"
                                                 else ""))
    if row["foreign_load"] is not None and row["foreign_load"] > args.max_foreign_load:
        notes.append(f"busy: other processes used {row['foreign_load']:.2f} CPUs")
    row["status"] = "; ".join(notes) if notes else "ok"
    row["failed"] = any(row[f"{side}_status"] in ("error", "failed", "timeout")
                        for side in ("torch", "mha"))
    return row


def main():
    parser = argparse.ArgumentParser(
        description="Time PyTorch nn.MultiheadAttention and mha_bench <mode>/<kernel>, alternating.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mha-bench", required=True, help="path to the mha_bench executable")
    parser.add_argument("--threads", type=int, default=nproc(),
                        help="threads for both sides (torch.set_num_threads, OMP_NUM_THREADS)")
    parser.add_argument("--mode", choices=["forward", "train"], default="forward",
                        help="time the forward pass, or a training step (forward + backward)")
    parser.add_argument("--kernel", default="auto", help="mha_bench kernel: reference, flash, auto")
    parser.add_argument("--mha-prefix",
                        help="mha_bench benchmark to time instead of <mode>/<kernel>/...: "
                             "<prefix>/<kernel>/..., e.g. forward_bf16 or forward_bf16_frozen")
    parser.add_argument("--torch-autocast", choices=["none", "bf16"], default="none",
                        help="forward mode: run torch's forward under "
                             "torch.autocast('cpu', dtype=torch.bfloat16)")
    parser.add_argument("--sweep", choices=["default", "heads", "length"], default="default")
    parser.add_argument("--config", type=parse_config, action="append", metavar="B,L,E,H",
                        help="measure these configurations instead of the sweep (repeatable)")
    parser.add_argument("--max-length", type=int, help="drop configurations with L above this")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed torch calls per round, --benchmark_repetitions for mha_bench")
    parser.add_argument("--rounds", type=int, default=2, help="alternating torch/mha rounds")
    parser.add_argument("--json", help="write all rows and the run's metadata to this file")
    parser.add_argument("--max-seconds-per-config", type=float, default=20.0,
                        help="skip a side whose single call (a forward, or a training step) takes "
                             "(or is predicted to take) longer")
    parser.add_argument("--skip-unregistered", action="store_true",
                        help="do not time torch for configs mha_bench does not register")
    parser.add_argument("--mha-arg", action="append", default=[], metavar="ARG",
                        help="extra mha_bench argument, e.g. --mha-arg=--benchmark_min_time=0.2")
    parser.add_argument("--mha-env", type=parse_env, action="append", default=[],
                        metavar="KEY=VALUE", help="extra environment variable for mha_bench")
    parser.add_argument("--mha-mem-fraction", type=float, default=0.75,
                        help="address-space limit of the mha_bench child as a fraction of "
                             "MemAvailable (0 = no limit)")
    parser.add_argument("--torch-omp-wait-policy", default="PASSIVE",
                        help="OMP_WAIT_POLICY for this (torch) process; empty = leave as is")
    parser.add_argument("--pause", type=float, default=0.1,
                        help="seconds to sleep between the torch and mha halves of a round")
    parser.add_argument("--no-torch-memory", dest="torch_memory", action="store_false",
                        help="in train mode, do not measure torch's peak memory (profiler)")
    parser.add_argument("--max-foreign-load", type=float, default=0.1,
                        help="CPUs other processes may use on average while a row is timed "
                             "before the row is marked busy")
    parser.add_argument("--retries", type=int, default=0,
                        help="measure a busy row again up to this many times")
    parser.add_argument("--busy-pause", type=float, default=60.0,
                        help="most seconds to wait for an idle machine before measuring a busy "
                             "row again")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads < 1 or args.repeats < 1 or args.rounds < 1:
        parser.error("--threads, --repeats and --rounds must be at least 1")
    if args.torch_autocast != "none" and args.mode == "train":
        parser.error("--torch-autocast is for --mode forward")
    if args.mha_prefix is not None and not re.fullmatch(r"[A-Za-z0-9_]+", args.mha_prefix):
        parser.error(f"--mha-prefix must be a plain name, got {args.mha_prefix!r}")
    if args.retries < 0:
        parser.error("--retries must not be negative")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", args.kernel):
        parser.error(f"--kernel must be a plain name, got {args.kernel!r}")
    if args.max_seconds_per_config <= 0:
        parser.error("--max-seconds-per-config must be positive")

    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json: directory of {args.json!r} does not exist")
    configs = args.config if args.config else sweep_configs(args.sweep)
    if args.max_length is not None:
        configs = [c for c in configs if c[1] <= args.max_length]
    if not configs:
        parser.error("no configuration left to measure")

    try:
        bench = MhaBench(args.mha_bench, args.threads, args.mha_arg, dict(args.mha_env),
                         args.mha_mem_fraction)
    except SetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    # The torch process's own threading, set before torch (and OpenBLAS, libgomp) load.
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.torch_omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.torch_omp_wait_policy
    try:
        import torch
    except Exception as error:  # ImportError, or a broken install failing to load its libraries
        print(f"error: cannot import torch ({error}); run with Debian's /usr/bin/python3 "
              f"(python3-torch)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    blas = torch_blas(torch)
    if reference_blas_error(blas):
        print(f"error: {reference_blas_error(blas)}", file=sys.stderr)
        return 2

    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    meta = {
        "sweep": "custom" if args.config else args.sweep,
        "mode": args.mode,
        "mha_prefix": args.mha_prefix,
        "torch_autocast": args.torch_autocast,
        "kernel": args.kernel,
        "threads": args.threads,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "max_seconds_per_config": args.max_seconds_per_config,
        "max_foreign_load": args.max_foreign_load,
        "retries": args.retries,
        "command": command,
        "mha_bench": os.path.abspath(args.mha_bench),
        "mha_bench_args": args.mha_arg,
        "cpu_model": cpu_model(),
        "nproc": nproc(),
        "mem_available_gib": (mem_available_bytes() or 0) / 2**30,
        "hostname": platform.node(),
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_blas": blas,
        "torch_env": {k: os.environ.get(k) for k in
                      ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                       "OPENBLAS_CORETYPE", "GLIBC_TUNABLES")},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mha_bench_context": None,
        "complete": False,
    }

    columns = TRAIN_COLUMNS if args.mode == "train" else COLUMNS
    what = "training step" if args.mode == "train" else "forward"
    print(f"# {len(configs)} configs, {what}, mha kernel '{args.kernel}', {args.threads} "
          f"thread(s), {args.rounds} rounds x {args.repeats} repeats per side, alternating "
          f"torch/mha")
    print(table_line([c[0] for c in columns], columns))
    print(table_line(["-" * max(w, len(n)) for n, w, _ in columns], columns), flush=True)
    rows = []
    history = {"torch": {}, "mha": {}}
    interrupted = False
    try:
        for config in configs:
            attempts = []
            while True:
                if args.retries:
                    wait_for_idle(args.max_foreign_load, args.busy_pause)
                attempts.append(measure(args, config, bench, torch, history))
                load = attempts[-1]["foreign_load"]
                if load is None or load <= args.max_foreign_load or len(attempts) > args.retries:
                    break
                print(f"# {table_line(row_cells(attempts[-1], args.mode), columns)}\n"
                      f"#   busy ({load:.2f} CPUs used by other processes): measuring again when "
                      f"idle, or in {args.busy_pause:g} s", flush=True)
            row = min(attempts, key=lambda r: math.inf if r["foreign_load"] is None
                      else r["foreign_load"])
            row["attempt_foreign_loads"] = [r["foreign_load"] for r in attempts]
            for side in ("torch", "mha"):  # the time guards predict from the kept attempt
                if row[f"{side}_ms"]:
                    history[side][config] = row[f"{side}_ms"] * 1e-3
            rows.append(row)
            print(table_line(row_cells(row, args.mode), columns), flush=True)
            if args.json:
                meta["mha_bench_context"] = bench.context
                write_json(args.json, meta, rows)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted", file=sys.stderr)

    meta["complete"] = not interrupted
    meta["mha_bench_context"] = bench.context
    if args.json:
        write_json(args.json, meta, rows)
    print(f"# command: {command}")
    print(f"# machine: {meta['cpu_model']}, nproc {meta['nproc']}, torch {meta['torch_version']} "
          f"({meta['torch_num_threads']} threads, OPENBLAS_NUM_THREADS="
          f"{meta['torch_env']['OPENBLAS_NUM_THREADS']}, OMP_WAIT_POLICY="
          f"{meta['torch_env']['OMP_WAIT_POLICY']}), mha_bench OMP_NUM_THREADS={args.threads}"
          + (f"; wrote {args.json}" if args.json else ""))
    if interrupted:
        return 130
    failed = [row for row in rows if row["failed"]]
    if failed:
        print(f"error: {len(failed)} configuration(s) failed to measure", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
