#!/usr/bin/env bash
# One call on the lent GPU machine (device tool): build, run the GPU tests, run the benchmark.
# Logs and result files go under $OUT (default ./gpu_out); a short summary table is printed last.
#
#   bash scripts/gpu_run.sh [--tests-only|--bench-only] [extra benchmark args...]
#
# TESTS="tests/test_compile.py ..." narrows the second test stage (default: every test file but the P2P
# suite, which always runs first). With one GPU the benchmark (2+ ranks) is skipped, saying so; the
# P2P suite then runs one rank over NCCL and two ranks sharing the GPU (see tests/test_p2p_gpu.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
# NVLink multicast must stay off on these machines (shared hosts); never override these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

mode=all
case "${1:-}" in --tests-only|--bench-only) mode=${1#--}; shift ;; esac

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -12
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1

t0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1
build_rc=$?
echo "build rc=$build_rc ($(( $(date +%s) - t0 )) s); summary:"; grep -E "^\[nsa_cp\]|nsa_cp build" "$OUT/build.log" | head -20

test_rc=skipped
if [ "$mode" != bench-only ]; then
  # the P2P suite first, on its own, with per-rank progress logs (and stack dumps if a rank stalls)
  export NSA_TEST_LOG_DIR="$OUT/ranklogs" NSA_TEST_STACK_DUMP_S=90 NSA_TEST_PG_TIMEOUT_S=120
  t0=$(date +%s)
  NSA_CP_P2P_TIMEOUT_MS=20000 timeout "${P2P_TEST_TIMEOUT_S:-240}" python3 -m pytest tests/test_p2p_gpu.py -q -rs \
    -p no:cacheprovider >"$OUT/pytest_p2p.log" 2>&1
  p2p_rc=$?
  echo "p2p tests rc=$p2p_rc ($(( $(date +%s) - t0 )) s)"; tail -8 "$OUT/pytest_p2p.log"
  t0=$(date +%s)
  # shellcheck disable=SC2086  # TESTS is a list of paths
  timeout "${TEST_TIMEOUT_S:-300}" python3 -m pytest ${TESTS:-tests} -q -rs -p no:cacheprovider --ignore tests/test_p2p_gpu.py \
    >"$OUT/pytest.log" 2>&1
  test_rc=$?
  echo "other tests rc=$test_rc ($(( $(date +%s) - t0 )) s)"; tail -6 "$OUT/pytest.log"
  cat "$OUT"/ranklogs/rank*.log > "$OUT/ranks.log" 2>/dev/null; rm -rf "$OUT/ranklogs"
  unset NSA_TEST_LOG_DIR
  test_rc="p2p:$p2p_rc,other:$test_rc"
fi

bench_rc=skipped
if [ "$mode" != tests-only ]; then
  t0=$(date +%s)
  timeout 120 python3 benchmarks/host_overhead.py >"$OUT/host_overhead.log" 2>&1
  echo "host overhead rc=$?"; head -30 "$OUT/host_overhead.log"
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  if [ "$gpus" -ge 2 ]; then
    timeout "${BENCH_TIMEOUT_S:-300}" python3 benchmarks/gather_scatter.py --csv "$OUT/bench.csv" --json "$OUT/bench.json" "$@" \
      >"$OUT/bench.log" 2>&1
    bench_rc=$?
    python3 benchmarks/plot_busbw.py "$OUT/bench.csv" --out "$OUT/bench.png" >"$OUT/plot.log" 2>&1 || echo "plot failed (see plot.log)"
    # where a small gather's microseconds go: sync floor, entry barrier, push (diagnostic)
    # shellcheck disable=SC2086  # LATENCY_M is a list of sizes
    timeout 120 python3 benchmarks/p2p_latency.py --M ${LATENCY_M:-256} >"$OUT/p2p_latency.log" 2>&1
    echo "p2p latency rc=$?"
  else
    bench_rc="not run: $gpus GPU(s), the benchmark needs 2+"
  fi
  echo "bench rc=$bench_rc ($(( $(date +%s) - t0 )) s)"
fi

echo "=================== summary ==================="
echo "build rc=$build_rc  tests rc=$test_rc  bench rc=$bench_rc"
for log in pytest_p2p pytest; do
  printf '%-11s %s\n' "$log:" "$(grep -E "passed|failed|error" "$OUT/$log.log" 2>/dev/null | tail -1)"
done
grep -h "rs-accuracy" "$OUT/pytest_p2p.log" 2>/dev/null
[ -f "$OUT/p2p_latency.log" ] && tail -14 "$OUT/p2p_latency.log"
[ -f "$OUT/bench.log" ] && tail -60 "$OUT/bench.log"
