#!/usr/bin/env bash
# One call on the lent 2-GPU machine (no network there): carried wheels, build, GPU tests, the collective
# benchmark, the layer-tail benchmark, the example; a short summary table printed LAST.
#
#   bash scripts/gpu_run.sh                 # everything, about 9 minutes (TOTAL_S, default 540, is the budget)
#   bash scripts/gpu_run.sh --tests-only    # wheels, build, P2P suite, the other tests
#   bash scripts/gpu_run.sh --bench-only    # wheels, build, collective benchmark, layer tail, example
#   STAGES="build tail" bash scripts/gpu_run.sh   # any subset of: wheels build p2p tests faults fpcost sanitize
#                                                 #   bench tail overlap example (faults, fpcost, sanitize,
#                                                 #   overlap: opt-in)
#   bash scripts/gpu_run.sh [flags] [extra gather_scatter.py args...]
#
# Environment: OUT (default ./gpu_out), TOTAL_S, TESTS (paths for the second test stage; default every
# test file but the P2P suite), BENCH_ARGS (default: --M 256 2048 8192 32768 --imbalance 0.2 --rounds 15;
# the symmetric-buffer rows take the even layout of each M on their own),
# TAIL_ARGS / BOUNDARY_ARGS (layer_tail.py, tail and boundary parts; default their sweep),
# OVERLAP_ARGS (benchmarks/overlapped_boundary.py: the overlapped boundary against the serialized one;
# default its sweep, M 2048 4096 8192), EXAMPLE_COMMS (default "nsa_cp baseline"),
# EXTRA_DIAG=1 (also host_overhead.py: host us per public call and cProfiles, outside the budget),
# SANITIZE_TOOLS (default "memcheck racecheck synccheck"), SANITIZE_TESTS / SANITIZE_K (default: two
# ranks sharing the GPU through every P2P kernel family, agreeing and disagreeing calls, and the Triton
# norm / FP8 row kernels at H = 7168; ranks are separate processes: --target-processes all),
# FPCOST_ARGS (scripts/p2p_fingerprint_cost.py; default --worlds 1 2 --M 16 256).
# Each stage runs under `timeout`; the tests get what the budget leaves after the benchmark stages'
# reserve, so a slow test stage cannot eat the benchmarks.
#
# Files under $OUT (at most 8 come back from the device tool): logs.tar.gz (every log), bench.csv,
# bench.json, bench.png (collective benchmark), layer_tail.csv, layer_tail.json, boundary.csv
# (layer_tail.py --part boundary), overlapped_boundary.csv (overlap), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
# NVLink multicast must stay off on these machines (shared hosts); never override these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

STAGES=${STAGES:-"wheels build p2p tests bench tail example"}
case "${1:-}" in
  --tests-only) STAGES="wheels build p2p tests"; shift ;;
  --bench-only) STAGES="wheels build bench tail example"; shift ;;
esac
want() { [[ " $STAGES " == *" $1 "* ]]; }

TOTAL_S=${TOTAL_S:-540}
T0=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }
# budget CAP RESERVE: min(CAP, time left - RESERVE), never under 20 s
budget() { local c=$1 l; l=$(( $(left) - $2 )); [ "$l" -lt "$c" ] && c=$l; [ "$c" -lt 20 ] && c=20; echo "$c"; }
# what the later selected stages need (s): keeps the tests from eating the benchmarks
reserve_after_tests() {
  local r=0
  want bench && r=$((r + 100)); want tail && r=$((r + 130)); want example && r=$((r + 60))
  echo $r
}

# run_capped CAP LOG CMD...: CMD under `timeout` (CAP s, KILL 10 s later), its output into LOG; sets rc to its
# exit status, "timeout" where the cap ended it
run_capped() {
  local cap=$1 log=$2
  shift 2
  timeout -k 10 "$cap" "$@" >"$log" 2>&1
  rc=$?
  if [ "$rc" = 124 ]; then rc="timeout"; fi
}

SUMMARY=()
note() { SUMMARY+=("$(printf '%-16s %-9s %6s s  %s' "$1" "$2" "$3" "${4:-}")"); }

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  stages: $STAGES  budget: ${TOTAL_S} s"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -6
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$LOGS/env.log"
# GPUS=2 with CPU-sized *_ARGS (--cpu-ranks 2 ...) and EXAMPLE_DEVICE=cpu: a dry run of the script on a CPU machine
GPUS=${GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}

# ---------------------------------------------------------------- wheels (carried: .whl/, no index)
JIT_PID=""
if want wheels; then
  t=$(date +%s)
  if compgen -G ".whl/*.whl" >/dev/null; then
    rm -rf /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$LOGS/wheels.log" 2>&1
    rc=$?
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi_v=$(python3 -c 'import flashinfer; print(flashinfer.__version__)' 2>>"$LOGS/wheels.log" || echo "not importable")
    note wheels "$rc" $(( $(date +%s) - t )) "$(ls .whl | tr '\n' ' ')-> flashinfer $fi_v"
    if [ "$fi_v" != "not importable" ] && want tail; then
      # shell variables and headers flashinfer's JIT needs on this image (scripts/flashinfer_jit_env.sh)
      source scripts/flashinfer_jit_env.sh && flashinfer_jit_env "$LOGS/wheels.log"
      # JIT-build flashinfer's norm kernel in the background while the build and tests run (CPU work)
      ( timeout 300 python3 -c 'import flashinfer.norm as n, time; t = time.time(); n.get_norm_module(); print(f"flashinfer norm module ready in {time.time() - t:.1f} s")' \
        >"$LOGS/flashinfer_jit.log" 2>&1 ) &
      JIT_PID=$!
    fi
  else
    note wheels skipped 0 "no .whl/*.whl (carry .whl): baseline norm falls back to nsa_cp.RMSNorm"
  fi
fi

# ---------------------------------------------------------------- build
build_rc=skipped
if want build; then
  t=$(date +%s)
  timeout -k 10 "$(budget 240 0)" python3 -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/build.log" 2>&1
  build_rc=$?
  note build "$build_rc" $(( $(date +%s) - t )) "$(grep -E '^\[nsa_cp\]|nsa_cp build' "$LOGS/build.log" | tail -1)"
  grep -E "^\[nsa_cp\]|nsa_cp build" "$LOGS/build.log" | head -20
fi

# ---------------------------------------------------------------- tests
pytest_line() { grep -E "[0-9]+ (passed|failed|error)" "$1" 2>/dev/null | tail -1 | tr -d '='; }
if want p2p || want tests; then
  # per-rank progress logs (and stack dumps if a rank stalls) of the distributed tests
  export NSA_TEST_LOG_DIR="$LOGS/ranklogs" NSA_TEST_STACK_DUMP_S=90 NSA_TEST_PG_TIMEOUT_S=120
fi
if want p2p; then
  t=$(date +%s)
  reserve=$(reserve_after_tests); want tests && reserve=$((reserve + 60))  # the other tests' least share
  cap=$(budget "${P2P_TEST_TIMEOUT_S:-180}" "$reserve")
  # SIGINT at the limit: pytest stops where it is and still prints its counts (and the failures so far)
  NSA_CP_P2P_TIMEOUT_MS=20000 timeout -s INT -k 20 "$cap" python3 -m pytest tests/transports/test_p2p_gpu.py -q -rfs \
    -p no:cacheprovider >"$LOGS/pytest_p2p.log" 2>&1
  rc=$?; [ "$rc" = 124 ] && rc="timeout"
  note "p2p tests" "$rc" $(( $(date +%s) - t )) "$(pytest_line "$LOGS/pytest_p2p.log") (limit $cap s)"
fi
if want tests; then
  t=$(date +%s)
  cap=$(budget "${TEST_TIMEOUT_S:-330}" "$(reserve_after_tests)")
  # shellcheck disable=SC2086  # TESTS is a list of paths
  timeout -s INT -k 20 "$cap" python3 -m pytest ${TESTS:-tests} -q -rfs -p no:cacheprovider --ignore tests/transports/test_p2p_gpu.py \
    >"$LOGS/pytest.log" 2>&1
  rc=$?; [ "$rc" = 124 ] && rc="timeout"
  note "other tests" "$rc" $(( $(date +%s) - t )) "$(pytest_line "$LOGS/pytest.log") (limit $cap s)"
fi
if want faults; then
  # cp = 8 faults and the call fingerprint (ranks sharing GPU 0 where there are fewer than 8 GPUs)
  t=$(date +%s)
  cap=$(budget "${FAULT_TEST_TIMEOUT_S:-240}" "$(reserve_after_tests)")
  timeout -s INT -k 20 "$cap" python3 -m pytest tests/transports/test_p2p_faults.py -q -rfs -p no:cacheprovider \
    >"$LOGS/pytest_faults.log" 2>&1
  rc=$?; [ "$rc" = 124 ] && rc="timeout"
  note "fault tests" "$rc" $(( $(date +%s) - t )) "$(pytest_line "$LOGS/pytest_faults.log") (limit $cap s)"
fi
if [ -d "$LOGS/ranklogs" ]; then cat "$LOGS"/ranklogs/rank*.log >"$LOGS/ranks.log" 2>/dev/null; rm -rf "$LOGS/ranklogs"; fi
unset NSA_TEST_LOG_DIR

# ---------------------------------------------------------------- the call fingerprint's cost (A/B, one run)
if want fpcost; then
  t=$(date +%s)
  # shellcheck disable=SC2086  # FPCOST_ARGS is a list of arguments
  run_capped "$(budget 120 0)" "$LOGS/fpcost.log" python3 scripts/p2p_fingerprint_cost.py \
    ${FPCOST_ARGS:---worlds 1 2 --M 16 256}
  note "fingerprint A/B" "$rc" $(( $(date +%s) - t )) "table below"
fi

# ---------------------------------------------------------------- compute-sanitizer (docs/development.md)
if want sanitize; then
  # Each tool over the same tests; clean is 0 errors in the one summary that --target-processes all
  # prints for the parent and every rank together. The tools serialize a process's kernels, so peers are
  # processes (in-process simulated ranks would wait on kernels that cannot run beside them).
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    t=$(date +%s)
    cap=$(budget "${SANITIZE_TIMEOUT_S:-200}" 0)
    # shellcheck disable=SC2086
    timeout -s INT -k 20 "$cap" compute-sanitizer --tool "$tool" --target-processes all --print-limit 20 \
      python3 -m pytest ${SANITIZE_TESTS:-tests/transports/test_p2p_faults.py tests/kernels/test_norm_kernels.py} -q -s -p no:cacheprovider \
      -k "${SANITIZE_K:-(smaller_worlds and gather-double-buffered-2) or production_row_length}" \
      >"$LOGS/sanitize_$tool.log" 2>&1
    rc=$?; [ "$rc" = 124 ] && rc="timeout"
    # one summary for all the processes (memcheck / synccheck: "ERROR SUMMARY: N errors"; racecheck:
    # "RACECHECK SUMMARY: ... (N errors, M warnings)")
    errors=$(grep -h "SUMMARY" "$LOGS/sanitize_$tool.log" | grep -o "[0-9]* errors" | awk '{s += $1} END {print s + 0}')
    note "sanitize $tool" "$rc" $(( $(date +%s) - t )) "$errors errors; $(pytest_line "$LOGS/sanitize_$tool.log")"
  done
fi

# ---------------------------------------------------------------- benchmarks (2+ GPUs)
if want bench; then
  t=$(date +%s)
  if [ "$GPUS" -ge 2 ]; then
    reserve=0; want tail && reserve=$((reserve + 130)); want example && reserve=$((reserve + 60))
    cap=$(budget 200 "$reserve")
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
    run_capped "$cap" "$LOGS/bench.log" python3 benchmarks/gather_scatter.py \
      ${BENCH_ARGS:---M 256 2048 8192 32768 --imbalance 0.2 --rounds 15} --csv "$OUT/bench.csv" --json "$OUT/bench.json" "$@"
    python3 benchmarks/plot_busbw.py "$OUT/bench.csv" --out "$OUT/bench.png" >"$LOGS/plot.log" 2>&1 || echo "plot failed (see plot.log)"
    note "collective" "$rc" $(( $(date +%s) - t )) "$(grep -c '^  check ok' "$LOGS/bench.log") configurations checked (limit $cap s)"
  else
    note "collective" skipped 0 "$GPUS GPU(s): the benchmark needs 2+"
  fi
fi
if want tail; then
  t=$(date +%s)
  if [ -n "$JIT_PID" ]; then wait "$JIT_PID"; tail -2 "$LOGS/flashinfer_jit.log"; fi
  if [ "$GPUS" -ge 2 ]; then
    reserve=40; want example && reserve=$((reserve + 60))  # the boundary part after it
    cap=$(budget 150 "$reserve")
    # shellcheck disable=SC2086  # TAIL_ARGS is a list of arguments
    run_capped "$cap" "$LOGS/layer_tail.log" python3 benchmarks/layer_tail.py ${TAIL_ARGS:-} \
      --csv "$OUT/layer_tail.csv" --json "$OUT/layer_tail.json"
    note "layer tail" "$rc" $(( $(date +%s) - t )) "$(grep -m1 '^baseline norm' "$LOGS/layer_tail.log" | cut -c1-100) (limit $cap s)"
    t=$(date +%s)
    cap=$(budget 100 "$( want example && echo 60 || echo 0)")
    # shellcheck disable=SC2086
    run_capped "$cap" "$LOGS/boundary.log" python3 benchmarks/layer_tail.py --part boundary ${BOUNDARY_ARGS:-} \
      --csv "$OUT/boundary.csv"
    note "boundary" "$rc" $(( $(date +%s) - t )) "layer_tail.py --part boundary (limit $cap s)"
  else
    note "layer tail" skipped 0 "$GPUS GPU(s): the benchmark needs 2+"
  fi
fi

if want overlap; then
  t=$(date +%s)
  if [ "$GPUS" -ge 2 ]; then
    cap=$(budget 240 "$( want example && echo 60 || echo 0)")
    # shellcheck disable=SC2086  # OVERLAP_ARGS is a list of arguments
    run_capped "$cap" "$LOGS/overlapped_boundary.log" python3 benchmarks/overlapped_boundary.py ${OVERLAP_ARGS:-} \
      --csv "$OUT/overlapped_boundary.csv"
    note "overlap" "$rc" $(( $(date +%s) - t )) "overlapped_boundary.py (limit $cap s)"
  else
    note "overlap" skipped 0 "$GPUS GPU(s): the benchmark needs 2+, one per rank"
  fi
fi

# ---------------------------------------------------------------- example
if want example; then
  if [ ! -f examples/nsa_prefill.py ]; then
    note example skipped 0 "examples/nsa_prefill.py not in this checkout"
  elif [ "$GPUS" -lt 2 ]; then
    note example skipped 0 "$GPUS GPU(s): the example runs 2 ranks"
  else
    if command -v torchrun >/dev/null; then RUN=(torchrun); else RUN=(python3 -m torch.distributed.run); fi
    for comm in ${EXAMPLE_COMMS:-nsa_cp baseline}; do
      t=$(date +%s)
      cap=$(budget 60 0)
      run_capped "$cap" "$LOGS/example_$comm.log" "${RUN[@]}" --nproc-per-node 2 examples/nsa_prefill.py \
        --device "${EXAMPLE_DEVICE:-cuda}" --comm "$comm"
      note "example $comm" "$rc" $(( $(date +%s) - t )) "$(grep -v '^\s*$' "$LOGS/example_$comm.log" | grep -v -i warn | tail -1 | cut -c1-110)"
    done
  fi
fi

# ---------------------------------------------------------------- optional diagnostics (outside the budget)
if [ "${EXTRA_DIAG:-0}" = 1 ] && [ "$GPUS" -ge 2 ]; then
  timeout -k 10 120 python3 benchmarks/host_overhead.py >"$LOGS/host_overhead.log" 2>&1
  note "host overhead" "$?" 0 "host_overhead.log in logs.tar.gz"
fi

# ---------------------------------------------------------------- files and summary
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
{
  # details first, the stage table last (the device tool returns the end of the output)
  if [ -f "$LOGS/layer_tail.log" ]; then
    echo "layer tail (device ms: host enqueuing ahead; eager ms: host-inclusive; x base: over sglang / sglang_fp8):"
    grep -E "CORRECTNESS FAILURE|Traceback" "$LOGS/layer_tail.log" | head -3
    sed -n '/^baseline norm: .*stand-in/,/^layer-tail goals/p' "$LOGS/layer_tail.log" | grep -v -E "skipped:|^$|^layer-tail goals"
    grep -E "skipped:" "$LOGS/layer_tail.log" | sort -u -k1,1 | head -13
  fi
  if [ -f "$LOGS/bench.log" ]; then
    grep -E "CORRECTNESS FAILURE|Traceback" "$LOGS/bench.log" | head -3
    sed -n '/^host us per call/,$p' "$LOGS/bench.log"
  fi
  [ -f "$LOGS/layer_tail.log" ] && sed -n '/^layer-tail goals/,$p' "$LOGS/layer_tail.log"
  if [ -f "$LOGS/boundary.log" ]; then
    grep -E "CORRECTNESS FAILURE|Traceback" "$LOGS/boundary.log" | head -3
    grep -E "skipped:" "$LOGS/boundary.log" | sort -u -k1,1 | head -11
    sed -n '/^boundary goals/,$p' "$LOGS/boundary.log"
  fi
  for log in pytest_p2p pytest; do
    grep -E "^(FAILED|ERROR) " "$LOGS/$log.log" 2>/dev/null | head -8
  done
  grep -h "rs-accuracy" "$LOGS/pytest_p2p.log" 2>/dev/null | head -3
  grep -E "^(FAILED|ERROR) " "$LOGS/pytest_faults.log" 2>/dev/null | head -8
  for tool in memcheck racecheck synccheck; do
    grep -h -B2 -A6 "^========= [A-Z]" "$LOGS/sanitize_$tool.log" 2>/dev/null | grep -v "ERROR SUMMARY" | head -12
  done
  [ -f "$LOGS/fpcost.log" ] && tail -12 "$LOGS/fpcost.log"
  if [ -f "$LOGS/overlapped_boundary.log" ]; then
    grep -E "CORRECTNESS FAILURE|Traceback" "$LOGS/overlapped_boundary.log" | head -3
    sed -n '/^x serialized:/,/^wrote /p' "$LOGS/overlapped_boundary.log" | grep -v "^wrote "
  fi
  echo
  echo "=================== summary ($(( $(date +%s) - T0 )) s of ${TOTAL_S}; files: $(cd "$OUT" && ls | tr '\n' ' ')) ==================="
  printf '%-16s %-9s %6s    %s\n' stage rc time result
  printf '%s\n' "${SUMMARY[@]}"
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
