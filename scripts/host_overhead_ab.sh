#!/usr/bin/env bash
# benchmarks/host_overhead.py before and after a change, in one device call: the same (current) script
# against two library trees, alternating runs, then one table of medians and after/before ratios.
#
#   bash scripts/host_overhead_ab.sh prepare REV   # here: git archive REV (the "before" tree) into .host_ab/base
#   bash scripts/host_overhead_ab.sh run           # on the GPU machine (carry .host_ab): builds both, measures
#
# Both trees build nsa_cp._C in place and are imported through PYTHONPATH, so nothing may be installed:
# an editable install of nsa_cp would shadow PYTHONPATH (its finder wins), which `run` removes first and
# then checks (it stops when "before" does not import from .host_ab/base). Environment: RUNS (default
# "1 2": alternations), MS (default 256: NCCL rows, one rank; empty: none), SHARED (default 2: ranks sharing the GPU
# for the P2P rows; empty to skip), CALLS (300), CONCURRENT (default 1: each round runs the two trees at
# the same time, on the two CPU sets PIN and PIN2, which they swap every round; 0: one after the other,
# alternating the order, all on PIN), PIN (default "4-7") and PIN2 (default "8-11"): the taskset CPU
# lists (PIN empty: not pinned). Output under $OUT (default ./gpu_out): the runs' logs and ab_table.txt.
# Side by side, a drift of the machine (on 1x H200 one tree's x.new_empty floor went from 4.3 to 11.3 us
# over four runs of about 15 s) reaches both trees of a round alike: the paired ratio (after_i /
# before_i) and the per-floor one (scripts/host_overhead_ab.py) compare within a round. The two trees
# share the GPU and the host, so their absolute numbers are higher than a run alone.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    rev=${2:?usage: host_overhead_ab.sh prepare REV}
    rm -rf .host_ab && mkdir -p .host_ab/base
    git archive "$rev" nsa_cp csrc setup.py pyproject.toml CMakeLists.txt | tar -x -C .host_ab/base
    git rev-parse --short "$rev" > .host_ab/base/REV
    echo "before tree $(cat .host_ab/base/REV) in .host_ab/base; carry .host_ab to the device"
    exit 0 ;;
  run) ;;
  *) echo "usage: host_overhead_ab.sh prepare REV | run" >&2; exit 2 ;;
esac
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export NSA_CP_CUDA_ARCHS=${NSA_CP_CUDA_ARCHS:-90a}
T0=$(date +%s)
PIN=${PIN-4-7} PIN2=${PIN2-8-11} CONCURRENT=${CONCURRENT:-1}
pinned() {  # pinned CPUS CMD...: CMD on the CPU list CPUS (taskset), or as it is
  local cpus=$1; shift
  if [ -n "$cpus" ] && command -v taskset >/dev/null; then taskset -c "$cpus" "$@"; else "$@"; fi
}
log() { echo "$* ($(( $(date +%s) - T0 )) s)" | tee -a "$OUT/ab_log.txt"; }
python3 -m pip uninstall -y nsa_cp >/dev/null 2>&1
python3 setup.py build_ext --inplace >"$OUT/build_after.log" 2>&1; log "build after rc=$?"
(cd .host_ab/base && python3 setup.py build_ext --inplace >"$OUT/build_before.log" 2>&1); log "build before rc=$?"
for tree in before after; do
  pp=$PWD; [ $tree = before ] && pp=$PWD/.host_ab/base
  # from / : `python -c` puts the working directory (this checkout) ahead of PYTHONPATH; the benchmark's
  # sys.path[0] is benchmarks/, which holds no nsa_cp
  got=$(cd / && PYTHONPATH=$pp python3 -c "import nsa_cp, nsa_cp._C; print(nsa_cp.__file__)" 2>&1 | tail -1)
  log "$tree imports $got"
  case "$got" in "$pp/nsa_cp/__init__.py") ;; *) log "$tree does not import its own tree: stop"; exit 3 ;; esac
done
one_tree() {  # one_tree TREE RUN CPUS: every configured host_overhead.py run of TREE, logs under $OUT
  local tree=$1 i=$2 cpus=$3 pp=$PWD m
  [ "$tree" = before ] && pp=$PWD/.host_ab/base
  for m in ${MS-256}; do
    pinned "$cpus" env PYTHONPATH="$pp" timeout 150 python3 benchmarks/host_overhead.py --M "$m" \
      --calls "${CALLS:-300}" --profile 1 >"$OUT/ho_${tree}_M${m}_$i.txt" 2>&1
    log "$tree M=$m run $i (CPUs ${cpus:-any}) rc=$?"
  done
  if [ -n "${SHARED-2}" ]; then
    pinned "$cpus" env PYTHONPATH="$pp" NSA_CP_P2P_TIMEOUT_MS=60000 timeout 200 python3 benchmarks/host_overhead.py \
      --M 256 --calls "${CALLS:-300}" --profile 1 --shared-gpu "${SHARED-2}" >"$OUT/ho_${tree}_M256s${SHARED-2}_$i.txt" 2>&1
    log "$tree shared-gpu ${SHARED-2} M=256 run $i (CPUs ${cpus:-any}) rc=$?"
  fi
}
n=0
for i in ${RUNS:-1 2}; do
  # every other round swaps: the CPU sets (side by side) or the order (one after the other), so neither
  # the cores nor a drift within a round falls on one tree
  first=before second=after; [ $((n++ % 2)) = 1 ] && first=after second=before
  if [ "$CONCURRENT" = 1 ]; then
    one_tree $first "$i" "$PIN" & one_tree $second "$i" "$PIN2" & wait
  else
    one_tree $first "$i" "$PIN"; one_tree $second "$i" "$PIN"
  fi
done
python3 scripts/host_overhead_ab.py "$OUT" | tee "$OUT/ab_table.txt"
