#!/usr/bin/env bash
# The whole GPU test line (`python -m pytest tests`) over device calls of at most 10 minutes each.
#
# Run one after the other the suite takes longer than one call allows, so this runs every test file, split
# by file into concurrent pytest processes on the one GPU, then the timing-sensitive P2P fault tests alone,
# and prints each part's counts and the total. Every file under tests/ lands in exactly one shard (the last
# takes whatever the others do not name), so nothing is left out.
#
#   bash scripts/gpu_test_line.sh            # after: python3 -m pip install --no-deps --no-build-isolation -e .
#                                            # (and SGLang's wheels, for tests/integrations/sglang/: scripts/gpu_sglang.sh)
#   CAP_S=480 LOGS=/tmp/logs bash scripts/gpu_test_line.sh
#   REST_SPLIT=8 SHARDS="rest" bash scripts/gpu_test_line.sh   # "rest" as 8 concurrent processes
#
# The line in three calls, every shard in one of them:
#   REST_SPLIT=6 SHARDS="p2p boundary collectives seams overlap rest faults" bash scripts/gpu_test_line.sh
#       (without SGLang carried: SGLang's CPU tests skip there, CI runs them)
#   source scripts/gpu_sglang.sh && SHARDS="example runs engines sglang_gpu" bash scripts/gpu_test_line.sh
#   source scripts/gpu_sglang.sh && SHARDS="sglang" bash scripts/gpu_test_line.sh
#
# Each shard runs under `timeout -s INT` (pytest stops where it is and still prints its counts and the
# failures so far; such a shard is flagged INTERRUPTED, its counts are not the shard's). Exit status: 0
# only when every shard ran to its end and passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
CAP_S=${CAP_S:-420}        # the concurrent shards
FAULTS_S=${FAULTS_S:-100}  # the fault tests, alone (they time peers' arrivals)
LOGS=${LOGS:-${OUT:-$PWD/gpu_out}}
mkdir -p "$LOGS"

# shards (files), the busiest first; "rest" is every other test file but the fault tests
SHARD_p2p="tests/transports/test_p2p_gpu.py"
SHARD_example="tests/package/test_example.py tests/package/test_example_exit.py"
SHARD_runs="tests/bench/test_benchmarks_smoke.py"
# the engines' shapes through nsa_cp on the GPU (with "runs" in one shard they outran a 480 s cap)
SHARD_engines="tests/integrations/sglang/test_sglang_gpu.py tests/integrations/vllm/test_vllm_shapes.py"
# SGLang's stack on the GPU at 2, 4 and 8 ranks sharing it (each world imports SGLang: 140 s alone on 1x H200)
SHARD_sglang_gpu="tests/integrations/sglang/test_sglang_boundary_gpu.py tests/integrations/sglang/test_sglang_overlap_gpu.py"
# SGLang's own code on CPU / gloo (they skip where SGLang is not installed: scripts/gpu_sglang.sh). With
# SGLang carried, every rank process imports it: over 370 s on 1x H200's 16 cores beside the other shards
# (2026-12-01), so give it a call of its own (SHARDS="sglang")
SHARD_sglang="tests/integrations/sglang/test_sglang.py tests/integrations/sglang/test_sglang_real.py tests/integrations/sglang/test_sglang_fast_path.py tests/integrations/sglang/test_sglang_boundary.py"
SHARD_boundary="tests/communicator/test_boundary_gloo.py tests/communicator/test_boundary_gpu.py tests/collectives/test_collectives_gpu.py"
# the collectives on gloo and under torch.compile (with "boundary" in one shard they outran a 396 s cap on 1x H100)
SHARD_collectives="tests/collectives/test_collectives_gloo.py tests/collectives/test_compile.py"
# the transport seam and the P2P host layers on CPU / gloo (worlds in processes; "rest" outran its cap with them)
SHARD_seams="tests/package/test_tree_shape.py tests/transports/test_nccl_native.py tests/transports/test_p2p_cpu.py tests/transports/test_p2p_host_layers.py tests/transports/test_plan_p2p_adapter.py tests/transports/test_transport_seam.py"
# the overlapped boundary on CUDA, ranks sharing the GPU at 2, 3, 4 and 8 (each world spawns its processes)
SHARD_overlap="tests/collectives/test_overlap_gpu.py"
FAULTS="tests/transports/test_p2p_faults.py"
named=" $SHARD_p2p $SHARD_example $SHARD_runs $SHARD_engines $SHARD_sglang_gpu $SHARD_sglang $SHARD_boundary $SHARD_collectives $SHARD_seams $SHARD_overlap $FAULTS "
SHARD_rest=""
for f in $(find tests -name "test_*.py" | sort); do
  [[ "$named" == *" $f "* ]] || SHARD_rest+="$f "
done

ALL="p2p example runs engines sglang_gpu sglang boundary collectives seams overlap rest faults"
SHARDS=${SHARDS:-$ALL}
for shard in $SHARDS; do
  [[ " $ALL " == *" $shard "* ]] || { echo "unknown shard '$shard' (shards: $ALL)" >&2; exit 2; }
done
want() { [[ " $SHARDS " == *" $1 "* ]]; }

# A shard may run as several concurrent pytest processes ("parts", logs tests_PART.log), each a
# SHARD_<part> of pytest arguments; PARTS_<shard> names them (default: the shard alone).
split_by_file() {  # split_by_file SHARD: one part per file of SHARD_<shard>
  local shard=$1 k=0 f names=""
  local var="SHARD_$shard"
  for f in ${!var}; do
    printf -v "SHARD_${shard}_$k" '%s' "$f"; names+=" ${shard}_$k"; k=$(( k + 1 ))
  done
  printf -v "PARTS_$shard" '%s' "$names"
}
# REST_SPLIT=N: "rest" as N concurrent pytest processes (its files dealt round-robin), logs tests_rest_K.log
REST_SPLIT=${REST_SPLIT:-1}
if [ "$REST_SPLIT" -gt 1 ]; then
  dealt=()
  i=0
  for f in $SHARD_rest; do
    dealt[i % REST_SPLIT]+=" $f"; i=$(( i + 1 ))
  done
  PARTS_rest=""
  for (( k = 0; k < REST_SPLIT; k++ )); do
    [ -n "${dealt[k]:-}" ] || continue
    printf -v "SHARD_rest_$k" '%s' "${dealt[k]}"
    PARTS_rest+=" rest_$k"
  done
fi
# SGLang's CPU files, one process each: every rank imports SGLang, and as one process they outran a 480 s
# cap alone on 1x H100
split_by_file sglang
# SGLang's stack on the GPU: the boundary file, and the overlap file one process per world (its test ids
# start with the world: "[2-...]"), four spawned worlds that import SGLang in every rank
OVERLAP_SGL="tests/integrations/sglang/test_sglang_overlap_gpu.py"
SHARD_sglang_gpu_b="tests/integrations/sglang/test_sglang_boundary_gpu.py"
PARTS_sglang_gpu="sglang_gpu_b"
for w in 2 3 4 8; do
  printf -v "SHARD_sglang_gpu_w$w" '%s' "$OVERLAP_SGL -k $w-"; PARTS_sglang_gpu+=" sglang_gpu_w$w"
done
parts_of() { local var="PARTS_$1"; echo "${!var:-$1}"; }

pids=()
for shard in p2p example runs engines sglang_gpu sglang boundary collectives seams overlap rest; do
  want "$shard" || continue
  for part in $(parts_of "$shard"); do
    var="SHARD_$part"
    # shellcheck disable=SC2086
    timeout -s INT -k 20 "$CAP_S" python3 -m pytest ${!var} -q -rfs -p no:cacheprovider >"$LOGS/tests_$part.log" 2>&1 &
    pids+=("$!:$part")
  done
done
status=0
if want sglang_gpu; then  # a world the parts above do not name would run in none of them
  left=$(python3 -m pytest "$OVERLAP_SGL" --collect-only -q -p no:cacheprovider -k "not (2- or 3- or 4- or 8-)" 2>/dev/null | grep -c "::")
  [ "$left" = 0 ] || { echo "sglang_gpu: $left test(s) of $OVERLAP_SGL in no world's part" >&2; status=1; }
fi
for entry in "${pids[@]}"; do
  wait "${entry%%:*}" || status=1
done
# shellcheck disable=SC2086
if want faults; then
  timeout -s INT -k 20 "$FAULTS_S" python3 -m pytest $FAULTS -q -rfs -p no:cacheprovider >"$LOGS/tests_faults.log" 2>&1 || status=1
fi

total=""
reported=""
for shard in $ALL; do
  want "$shard" || continue
  reported+=" $(parts_of "$shard")"
done
for shard in $reported; do
  line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|(passed|failed|skipped|error).* in [0-9.]+s' "$LOGS/tests_$shard.log" | tail -1)
  cut=""
  if grep -q "KeyboardInterrupt" "$LOGS/tests_$shard.log"; then  # timeout -s INT: counts so far, not the shard
    cut="  INTERRUPTED at its cap: NOT complete"; status=1
  fi
  printf '%-9s %s%s\n' "$shard" "${line:-no counts (killed?): see $LOGS/tests_$shard.log}" "$cut"
  grep -E '^(FAILED|ERROR) ' "$LOGS/tests_$shard.log" | head -20
  total+="$line; "
done
python3 - "$total" <<'EOF'
import re, sys
sums = {}
for word in ("passed", "failed", "skipped", "error", "errors"):
    sums[word] = sum(int(n) for n in re.findall(rf"(\d+) {word}\b", sys.argv[1]))
print("total    ", ", ".join(f"{v} {k}" for k, v in sums.items() if v))
EOF
exit $status
