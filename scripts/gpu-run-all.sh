#!/usr/bin/env bash
# Runs on the GPU machine, from the bundle that scripts/gpu-bundle.sh made (copied there as
# run-all.sh):  bash gpu-bundle/run-all.sh [--quick]
# 1. the GPU tests with SSD_REQUIRE_GPU=1 (no GPU = failure): fuzz against the float64
#    reference, fixtures, reproducibility, refusals;
# 2. compute-sanitizer (memcheck, racecheck, initcheck (with SSD_GPU_WG=0), synccheck) over the fixed sanitizer
#    shapes (ragged seqlen, seq_idx, ngroups > 1, every option, dstate 256, chunk 256 and the
#    largest chunk size), the fixed packed (serving) shapes and the fixed bf16 shapes;
# 3. ssd-oracle run --impl gpu + check --precision tf32 on each fixture, and the same at
#    --precision bf16 on each unpacked one, when the CLI has it;
# 4. the Python package's pytest suite (when the bundle has its wheel), mamba_ssm's Triton forward
#    checked in-process among it;
# 5. the benchmark, f32 and bf16, against the anchors (mamba_ssm's and vLLM's Triton forwards,
#    fp32 and bf16) in $SSD_TRITON_ROUNDS processes (default 2; SSD_TRITON_DTYPES=fp32 or bf16
#    times one dtype's anchors alone, a shorter run; SSD_TRITON_NO_SERVING=1 skips the serving
#    shape's anchors) (skipped with --quick and --no-bench;
#    --bench-only runs it alone);
# --quick also cuts the fuzz suite to 200 cases (SSD_GPU_CASES overrides).
# then prints a summary table last. Logs go to $SSD_LOG_DIR (default: logs/ beside this file),
# and a tarball of them to $SSD_LOG_DIR/logs.tar.gz.
set -u
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
quick=0 bench=1 checks=1
case "${1:-}" in
  --quick) quick=1 bench=0 ;;
  --no-bench) bench=0 ;;
  --bench-only) checks=0 ;;
esac
logs=${SSD_LOG_DIR:-$here/logs}
rm -rf "$logs/all"; mkdir -p "$logs/all"
export SSD_REQUIRE_GPU=1
export SSD_FIXTURES_DIR="$here/fixtures"
[ $quick = 1 ] && export SSD_GPU_CASES=${SSD_GPU_CASES:-200}
rows=()

step() { # name, key-line pattern, command...
  local name=$1 pattern=$2
  shift 2
  local t0=$SECONDS
  "$@" >"$logs/all/$name.log" 2>&1
  local rc=$?
  local key
  key=$(grep -E "$pattern" "$logs/all/$name.log" | tail -n 3 | tr '\n' ' ' | cut -c1-220)
  local verdict=PASS
  [ $rc -ne 0 ] && verdict="FAIL($rc)"
  rows+=("$(printf '%-28s %-9s %5ss  %s' "$name" "$verdict" $((SECONDS - t0)) "$key")")
  echo "== $name: $verdict ($((SECONDS - t0)) s)"
  # The step's results as it ends (the default variant's lines), so that a run cut short by a
  # time limit still shows what finished; the summary below repeats them all.
  summary_lines "$logs/all/$name.log" | grep -v ' \[V' || true
}

summary_lines() { # the result lines of the given logs
  grep -h -o -E '^(fuzz|sanitizer shapes|fixtures|reproducible|packed [a-z ]+|serving fixtures|bf16 [a-z ]+|chained [a-z0-9]+):? .*' "$@" 2>/dev/null
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# The test archive that gpu-bundle.sh made, run by the cargo-nextest binary it carries (no
# cargo needed); extra arguments select the tests (`-E FILTER`) and pass options.
nextest() {
  bin/cargo-nextest nextest run --archive-file tests.tar.zst --workspace-remap workspace \
    --no-fail-fast --no-capture "$@"
}

if [ $checks = 1 ]; then
while read -r id; do
  step "test-${id#*::}" 'Summary|panicked|FAIL' nextest -E "binary_id($id)"
done <tests.txt

if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck initcheck synccheck; do
    # initcheck does not count the Hopper bf16 output kernel's TMA stores as writes (it reports
    # every byte of such an `out` when it is copied back): it runs with that kernel off
    # (SSD_GPU_WG=0, which the tests honour); the fully-written tests cover its stores.
    wg=1
    [ $tool = initcheck ] && wg=0
    step "sanitizer-$tool" 'ERROR SUMMARY|RACECHECK SUMMARY|test result' env SSD_GPU_WG=$wg \
      compute-sanitizer --tool "$tool" --error-exitcode 99 \
      bin/cargo-nextest nextest run --archive-file tests.tar.zst --workspace-remap workspace \
      --no-capture -E '(binary_id(ssd-verify::gpu_fuzz) & test(=gpu_sanitizer_shapes)) | (binary_id(ssd-verify::gpu_packed) & test(=gpu_packed_sanitizer_shapes)) | (binary_id(ssd-verify::gpu_bf16) & test(=gpu_bf16_sanitizer_shapes))'
  done
else
  rows+=("compute-sanitizer          MISSING")
fi

if [ -x bin/ssd-oracle ] && [ -d fixtures ]; then
  oracle() {
    local n=0 fail=0 tmp
    tmp=$(mktemp -d)
    for case in $(find fixtures -name '*.json' | sort); do
      grep -q 'ssd-fixture/1' "$case" || continue
      n=$((n + 1))
      if ! bin/ssd-oracle run --case "$case" --impl gpu --out "$tmp/c.safetensors" ||
        ! bin/ssd-oracle check --case "$case" --candidate "$tmp/c.safetensors" --precision tf32; then
        fail=$((fail + 1))
        echo "FAILED: $case"
      fi
      # bf16: unpacked cases (the command refuses a packed one in one line, and says so).
      if ! bin/ssd-oracle run --case "$case" --impl gpu --precision bf16 --out "$tmp/c.safetensors" 2>"$tmp/err"; then
        grep -q 'packed cases in tf32 only' "$tmp/err" && continue
        cat "$tmp/err"
        fail=$((fail + 1))
        echo "FAILED (bf16): $case"
        continue
      fi
      n=$((n + 1))
      if ! bin/ssd-oracle check --case "$case" --candidate "$tmp/c.safetensors" --precision bf16; then
        fail=$((fail + 1))
        echo "FAILED (bf16): $case"
      fi
    done
    echo "oracle: $n cases, $fail failing"
    [ $fail -eq 0 ]
  }
  step oracle-gpu-check 'oracle:|FAILED|error' oracle
fi

if [ -d wheels ] && [ -d python/tests ]; then
  # The Python package's pytest suite, with torch and mamba_ssm's Triton kernels in-process.
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    wheels/*.whl >"$logs/all/pip.log" 2>&1
  step python-pytest 'passed|failed|error' env PYTHONUNBUFFERED=1 \
    PYTHONPATH="$site:$here/anchors${PYTHONPATH:+:$PYTHONPATH}" SSD_ORACLE_BIN="$here/bin/ssd-oracle" \
    python3 -m pytest -q -s -rs -p no:cacheprovider python/tests
fi
fi

if [ $bench = 1 ]; then
  for b in bin/bench-*; do
    [ -x "$b" ] || continue
    step "$(basename "$b")" 'BENCH_JSON|skipped' "$b" --reps 30
    step triton-table '^\| \(|^\| 64|ceilings|unavailable' env PYTHONPATH="$here/anchors:$here/anchors/vllm_pkg${PYTHONPATH:+:$PYTHONPATH}" \
      python3 gpu_bench_table.py "$logs/all/$(basename "$b").log" --rounds "${SSD_TRITON_ROUNDS:-2}" --dtypes "${SSD_TRITON_DTYPES:-fp32,bf16}" ${SSD_TRITON_NO_SERVING:+--no-serving}
  done
fi

(cd "$logs" && tar czf logs.tar.gz all)
echo
echo "==================== summary ===================="
for r in "${rows[@]}"; do echo "$r"; done
summary_lines "$logs"/all/test-*.log
grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs"/all/sanitizer-*.log 2>/dev/null
if [ -f "$logs/all/triton-table.log" ]; then
  grep -E '^\||ceilings|^Triton|^Serving' "$logs/all/triton-table.log"
fi
# The exit status: 1 when any step failed, 0 otherwise.
for r in "${rows[@]}"; do
  case "$r" in *FAIL*|*MISSING*) exit 1 ;; esac
done
exit 0
