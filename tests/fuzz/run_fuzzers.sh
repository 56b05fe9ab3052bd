#!/usr/bin/env bash
# A bounded fuzzing run, as CI does it:
#   tests/fuzz/run_fuzzers.sh [SECONDS_PER_TARGET (60)] [BUILD_DIR (build-fuzz)]
# Configures a clang++ build with MHA_BUILD_FUZZERS=ON (or takes BUILD_DIR as it is, if it was
# configured with it), builds the four libFuzzer targets only, and runs them at once, each for
# SECONDS_PER_TARGET of processor time, on a copy of its committed corpus and regressions (under
# BUILD_DIR/fuzz-run; nothing is written to the source tree). Prints per target the executions,
# executions per second, corpus units, coverage and the inputs by outcome; exits 1 if any target
# found a crash, timeout, leak or out-of-memory, whose input is then kept in
# BUILD_DIR/fuzz-run/<target>/ (crash-*, timeout-*, leak-*, oom-*).
# MHA_JOBS sets the build's parallelism and the processors the fuzzers share (default: nproc).
set -euo pipefail

seconds=${1:-60}
build_dir=${2:-build-fuzz}
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "run_fuzzers.sh: SECONDS_PER_TARGET must be a positive integer, got '$seconds'" >&2
  exit 2
fi
repo_root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd)
fuzz_dir=$repo_root/tests/fuzz
jobs=${MHA_JOBS:-$(nproc)}

# The fuzzers and everything they link are instrumented: the whole build takes the sanitizers
# and libFuzzer's coverage (-fsanitize=fuzzer-no-link), so that the library's code (mha::compiled,
# mha_run's logic) guides the fuzzing too; the fuzz targets alone add -fsanitize=fuzzer.
# RelWithDebInfo at -O1 without NDEBUG, as the sanitizer stage of .ci/run: MHA_ASSERT and Eigen's
# index checks stay on. A BUILD_DIR configured already with MHA_BUILD_FUZZERS=ON is used as it is
# (.ci/run's sanitizer stage builds and tests in it first, with OpenMP); a new one is configured
# without OpenMP: libFuzzer runs one input at a time, and threads would only make runs slower and
# less reproducible (the thread split is tested by the ordinary tests). Either way each run has
# OMP_NUM_THREADS=1. Tools stay on because the tests' CMakeLists refers to mha_run; only the
# fuzzers are built.
fuzz_flags="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=all -fno-omit-frame-pointer"
if [[ -f "$build_dir/CMakeCache.txt" ]]; then
  if ! grep -q '^MHA_BUILD_FUZZERS:BOOL=ON' "$build_dir/CMakeCache.txt"; then
    echo "run_fuzzers.sh: $build_dir exists but was not configured with -DMHA_BUILD_FUZZERS=ON" >&2
    exit 2
  fi
else
  cmake -S "$repo_root" -B "$build_dir" -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS=$fuzz_flags" \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" -DMHA_BUILD_FUZZERS=ON -DMHA_USE_OPENMP=OFF \
    -DMHA_BUILD_TESTS=ON -DMHA_BUILD_TOOLS=ON -DMHA_BUILD_EXAMPLES=OFF \
    -DMHA_BUILD_BENCHMARKS=OFF >/dev/null
fi
export OMP_NUM_THREADS=1
targets=(fuzz_safetensors fuzz_mha_run fuzz_forward fuzz_paged_cache)
build_start=$SECONDS
cmake --build "$build_dir" -j "$jobs" --target mha_fuzzers
echo "run_fuzzers.sh: built ${targets[*]} in $((SECONDS - build_start))s"

# The inputs' size limits: a few fixtures' worth for files, a few hundred choices for forward.
declare -A max_len=([fuzz_safetensors]=4096 [fuzz_mha_run]=4096 [fuzz_forward]=512
  [fuzz_paged_cache]=256)
declare -A dict=([fuzz_safetensors]=$fuzz_dir/safetensors.dict
  [fuzz_mha_run]=$fuzz_dir/safetensors.dict [fuzz_forward]= [fuzz_paged_cache]=)

run_root=$build_dir/fuzz-run
rm -rf -- "$run_root"
# The targets run at once, each for SECONDS_PER_TARGET of processor time: with fewer jobs than
# targets they share the processors, and each runs for its share of the wall time
# (targets x seconds / jobs), which on two cores is 120 s each for four targets of 60 s.
wall_seconds=$(((${#targets[@]} * seconds + jobs - 1) / jobs))
((wall_seconds < seconds)) && wall_seconds=$seconds
declare -A pid
for target in "${targets[@]}"; do
  work=$run_root/$target
  mkdir -p -- "$work/corpus"
  cp -- "$fuzz_dir/corpus/$target"/* "$work/corpus/"
  if [[ -d "$fuzz_dir/regressions/$target" ]]; then
    cp -- "$fuzz_dir/regressions/$target"/* "$work/corpus/"
  fi
  units_before=$(find "$work/corpus" -type f | wc -l)
  options=(-max_total_time="$wall_seconds" -max_len="${max_len[$target]}" -rss_limit_mb=2048
    -timeout=10 -print_final_stats=1 -artifact_prefix="$work/")
  if [[ -n "${dict[$target]}" ]]; then options+=(-dict="${dict[$target]}"); fi
  echo "run_fuzzers.sh: $target for ${wall_seconds}s (${seconds}s of processor time) on $units_before inputs"
  "$build_dir/fuzzers/$target" "${options[@]}" "$work/corpus" >"$work/log" 2>&1 &
  pid[$target]=$!
done

failed=()
summary=()
for target in "${targets[@]}"; do
  work=$run_root/$target
  status=0
  wait "${pid[$target]}" || status=$?
  executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log")
  per_second=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/log")
  # libFuzzer's last status line, e.g. "#123 DONE cov: 1234 ft: 5678 corp: 90/12Kb ...".
  last=$(grep -E '^#[0-9]+' "$work/log" | tail -n 1 || true)
  coverage=$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$last")
  features=$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$last")
  corpus=$(sed -nE 's/.* corp: ([^ ]+).*/\1/p' <<<"$last")
  outcomes=$(grep -E "^$target: [0-9]+ inputs" "$work/log" | tail -n 1 || true)
  artifacts=$(find "$work" -maxdepth 1 -type f \
    \( -name 'crash-*' -o -name 'timeout-*' -o -name 'leak-*' -o -name 'oom-*' \) | sort)
  line="$target: ${executions:-?} executions in ${wall_seconds}s (${per_second:-?}/s of wall time), corpus ${corpus:-?} (units/size), cov ${coverage:-?}, ft ${features:-?}"
  summary+=("$line" "  ${outcomes:-(no outcome counts: the run did not exit normally)}")
  if ((status != 0)) || [[ -n "$artifacts" ]]; then
    failed+=("$target")
    summary+=("  FAILED (exit status $status); log: $work/log; inputs: ${artifacts:-none written}")
    grep -E -A30 '^==[0-9]+==ERROR|fuzz property violated|runtime error' "$work/log" | head -n 60 >&2 || true
  fi
done

printf '\n== fuzzing summary (%ss of processor time per target, %s at once on %s jobs)\n' "$seconds" "${#targets[@]}" "$jobs"
printf '%s\n' "${summary[@]}"
if ((${#failed[@]} > 0)); then
  echo "run_fuzzers.sh: FAILED: ${failed[*]} (reproduce: BINARY INPUT; keep the input under tests/fuzz/regressions/<target>/ once fixed)" >&2
  exit 1
fi
echo "run_fuzzers.sh: no crash in ${targets[*]}"
