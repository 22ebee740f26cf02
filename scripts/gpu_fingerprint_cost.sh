#!/usr/bin/env bash
# The torch.distributed path's agreement check (nsa_cp/transport/dist/agreement.py) on the GPU machine: its cost
# and its GPU tests, in one device call of under 4 minutes.
#
#   bash scripts/gpu_fingerprint_cost.sh OUTDIR
#
# 1. benchmarks/gather_scatter.py --agreement: NCCL, one rank per visible GPU (one GPU: world 1, where the
#    check's launches and bytes are all there but no link is), M 2048 8192 32768, H 7168, bf16; the same calls
#    with NSA_CP_AGREEMENT off / auto / separate, device time (events, GPU sleep ahead, interleaved, medians).
#    "vs ref": the added time as a share of 2x H200's even all-gather (docs/performance.md's anchors), the
#    gather a 2-rank call would pay at that M.
# 2. tests/collectives/test_agreement_gpu.py: NCCL world 1 (the grouped fingerprint, the kernel, the pinned
#    record, the raise) and ranks sharing the GPU over gloo (2 and 3; the device check forced there too);
#    tests/kernels/test_agree_kernel.py: the check kernel compiled, every result dtype, the pinned record.
# Logs under OUTDIR (env.txt, agreement_cost.txt/.csv, tests.txt, test_logs/); a short table last.
# Environment: PYTHON (default python3), ROUNDS (30).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_fingerprint_cost.sh OUTDIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
(cd / && $PY -c "import nsa_cp, torch, triton; print(nsa_cp.__file__, 'torch', torch.__version__, 'triton',
triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU',
'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-')") >"$OUT/env.txt" 2>&1
timeout 80 $PY benchmarks/gather_scatter.py --agreement --M 2048 8192 32768 --hidden 7168 --dtype bf16 \
  --rounds "${ROUNDS:-30}" --warmup 5 --ref-ms 2048=0.141,8192=0.488,32768=1.772 \
  --csv "$OUT/agreement_cost.csv" >"$OUT/agreement_cost.txt" 2>&1
bench_rc=$?
T1=$(date +%s)
NSA_TEST_LOG_DIR="$OUT/test_logs" timeout 150 $PY -m pytest -q -rs tests/collectives/test_agreement_gpu.py \
  tests/kernels/test_agree_kernel.py >"$OUT/tests.txt" 2>&1
test_rc=$?
T2=$(date +%s)
echo "== env: $(tail -1 "$OUT/env.txt")"
echo "== tests (rc $test_rc, $((T2 - T1)) s): $(tail -1 "$OUT/tests.txt")"
grep -E "^(FAILED|ERROR)|SKIPPED" "$OUT/tests.txt" | head -8
echo "== agreement cost (rc $bench_rc, $((T1 - T0)) s):"
tail -14 "$OUT/agreement_cost.txt"
