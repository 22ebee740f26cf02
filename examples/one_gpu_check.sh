#!/usr/bin/env bash
# One call on a one-GPU machine (no network there): install, the example's CUDA check with the ranks sharing
# the GPU at cp = 2, 3, 4, 8 (both splits; nsa_cp padded and compact, and the baseline over gloo on host
# copies; FP8 at cp = 8), then the work the compact layout saves at cp = 8 (docs/performance.md). Logs
# under $OUT (default ./gpu_out), a short table last.
#
#   bash examples/one_gpu_check.sh            # TOTAL_S (default 285; CPU 900) bounds the whole script
#   STAGES="build check:8,2 work check:3,4" bash examples/one_gpu_check.sh   # stages in this order
#   DEVICE=cpu STAGES=check bash examples/one_gpu_check.sh  # a dry run of the check stage on gloo CPU: a
#                        # smaller model, about 4 minutes on 2 CPU cores (cp = 2, 3, 4, 8; 2026-12-02)
#
# Every stage runs in a process group of its own and its cap ends the whole group (torchrun and every
# rank): nothing outlives the script.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export NSA_CP_CUDA_ARCHS=${NSA_CP_CUDA_ARCHS:-90a}
# ranks sharing one GPU map each other's buffers through CUDA IPC; a rank late by a slow neighbour's host
# loop must not time out
export NSA_CP_P2P_MEMORY=${NSA_CP_P2P_MEMORY:-cuda_ipc} NSA_CP_P2P_TIMEOUT_MS=${NSA_CP_P2P_TIMEOUT_MS:-60000}
STAGES=${STAGES:-"build check work"}
DEVICE=${DEVICE:-cuda}
TOTAL_S=${TOTAL_S:-$([ "$DEVICE" = cpu ] && echo 900 || echo 285)}
T0=$(date +%s)
# cap CAP RESERVE: min(CAP, time left - RESERVE), at least 15 s
cap() { local c=$1 l=$(( TOTAL_S - ($(date +%s) - T0) - $2 )); [ "$l" -lt "$c" ] && c=$l; [ "$c" -lt 15 ] && c=15; echo "$c"; }
# capped CAP cmd...: cmd in a session (and process group) of its own; at CAP seconds TERM to the whole group,
# KILL 5 s later; status 124 when the cap ended it
capped() {
  local cap=$1 pid watch rc
  shift
  setsid "$@" &
  pid=$!
  ( sleep "$cap"; kill -TERM -- "-$pid" 2>/dev/null && { sleep 5; kill -KILL -- "-$pid" 2>/dev/null; }; exit 0 ) &
  watch=$!
  wait "$pid"; rc=$?
  if kill -0 "$watch" 2>/dev/null; then
    kill "$watch" 2>/dev/null; wait "$watch" 2>/dev/null
  else
    rc=124
  fi
  return "$rc"
}
ROWS=()
row() { ROWS+=("$(printf '%-22s %-7s %5s s  %s' "$1" "$2" "$3" "$4")"); }
RUN=(python3 -m torch.distributed.run --standalone)

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/env.txt"

# the check: a small model (bf16 L2 tolerance 1e-1), every method of the example, both splits
CHECK=(--device "$DEVICE" --comm all --hidden 1024 --layers 2 --heads 16 --experts 24 --topk 4 --moe-intermediate 512
       --shared-intermediate 512 --seq-lens 700x8,3000 --page-size 64 --nsa-index-topk 256 --iters 0)
# on CPU (gloo, Triton's interpreter) a model a fifth of that: still requests longer than the indexer's top-256
[ "$DEVICE" = cpu ] && CHECK=(--device cpu --comm all --hidden 256 --layers 2 --heads 4 --experts 24 --topk 4
  --moe-intermediate 128 --shared-intermediate 128 --seq-lens 400x4,1200 --page-size 64 --nsa-index-topk 256 --iters 0)
CHECK_CAP_S=${CHECK_CAP_S:-$([ "$DEVICE" = cpu ] && echo 150 || echo 55)}
SHARED=--enable-nsa-prefill-cp-shared-kv
# the work the compact layout saves: cp = 8 ranks on the one GPU, the example's CUDA model (2 layers,
# H = 7168, 128 heads, 32 experts top-8), nsa_cp compact against the padded layout (the F.pad baseline's
# MoE rows) with the padding rows masked to -1 and routed
WORK=(--device "$DEVICE" "$SHARED" --comm nsa_cp_compact,nsa_cp --moe-padding both --layers 2 --no-check --warmup 2 --iters 5)

check() {  # check CP: the sweep of CHECK at cp ranks, both splits (and FP8 at cp = 8)
  local cp=$1 t rc extra=()
  t=$(date +%s)
  # cp = 8: the FP8 wire too (fp32: the check that tells the quantized wire's values, bf16: DeepSeek's dtype)
  [ "$cp" = 8 ] && extra=(:: "$SHARED" --quant fp8_e4m3_g128 --dtype float32 :: "$SHARED" --quant fp8_e4m3_g128)
  capped "$(cap "$CHECK_CAP_S" "$2")" "${RUN[@]}" --nproc-per-node "$cp" \
    examples/nsa_prefill_sweep.py "${CHECK[@]}" :: :: "$SHARED" "${extra[@]}" >"$OUT/check_cp$cp.log" 2>&1
  rc=$?; [ "$rc" = 124 ] && rc=timeout
  row "check cp=$cp" "$rc" $(( $(date +%s) - t )) \
    "$(grep -c ': max_rel_err=' "$OUT/check_cp$cp.log") method checks, $(grep -c 'FAILED$' "$OUT/check_cp$cp.log") FAILED"
}

work() {
  local t rc
  t=$(date +%s)
  capped "$(cap 150 "$1")" "${RUN[@]}" --nproc-per-node 8 examples/nsa_prefill_sweep.py "${WORK[@]}" \
    :: --seq-lens 700x64 :: --seq-lens 16384 >"$OUT/work_cp8.log" 2>&1
  rc=$?; [ "$rc" = 124 ] && rc=timeout
  row "work cp=8" "$rc" $(( $(date +%s) - t )) "$(grep -c 'over nsa_cp_compact' "$OUT/work_cp8.log") ratio lines"
}

# the stages in the order given; checks before the work stage leave it WORK_RESERVE_S, the work stage
# leaves the checks after it CHECK_RESERVE_S
WORK_RESERVE_S=${WORK_RESERVE_S:-90}
CHECK_RESERVE_S=${CHECK_RESERVE_S:-40}
worked=0
for stage in $STAGES; do
  case "$stage" in
    build)
      t=$(date +%s)
      capped "$(cap 150 100)" python3 -m pip install --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1
      rc=$?
      row build "$rc" $(( $(date +%s) - t )) "$(grep -E 'nsa_cp build|Successfully' "$OUT/build.log" | tail -1 | cut -c1-80)" ;;
    check) for cp in 2 3 4 8; do check "$cp" $(( worked ? 0 : WORK_RESERVE_S )); done ;;
    check:*) IFS=, read -ra cps <<<"${stage#check:}"; for cp in "${cps[@]}"; do check "$cp" $(( worked ? 0 : WORK_RESERVE_S )); done ;;
    work) rest=0; [[ " $STAGES " == *" work "*check* ]] && rest=$CHECK_RESERVE_S; work "$rest"; worked=1 ;;
    *) echo "unknown stage $stage" ;;
  esac
done

{
  for f in "$OUT"/check_cp*.log; do
    [ -f "$f" ] || continue
    echo "== $(basename "$f")"
    grep -E "^(sweep: run .* rc=)|^[a-z_/]+: max_rel_err=|Traceback|Error" "$f" | cut -c1-90 | head -40
  done
  if [ -f "$OUT/work_cp8.log" ]; then
    echo "== work_cp8.log"
    grep -E "^(nsa_prefill:|sweep: run|[a-z_/]+: MoE rows)|^  |Traceback|Error" "$OUT/work_cp8.log" | cut -c1-200
  fi
  echo
  echo "=========== one_gpu_check ($(( $(date +%s) - T0 )) s of $TOTAL_S) ==========="
  printf '%s\n' "${ROWS[@]}"
} | tee "$OUT/summary.txt"
