"""What a first-use check costs (NSA_CP_FIRST_USE_CHECKS): host time of the engine plugins' moves on CPU / gloo,
the engine's own move, nsa_cp's unchecked (NSA_CP_FIRST_USE_CHECKS=0) and nsa_cp's checked (the checks reset
before every call, so each call is a first call), interleaved round by round; median over rounds, max over ranks.

* ``--engine vllm`` (vLLM 0.34.0 venv): ``MoERunner._maybe_dispatch`` / ``_maybe_combine`` with vLLM's TRTLLM
  FP8 quant config (quantizes before the gather) or ``--bf16``, vLLM's own parallel state, its
  ``partition_batch`` of one prefill step (tests/support/vllm_env.py);
* ``--engine sglang`` (SGLang 0.5.23 venv): SGLang's DSA/MLA ``CpMoves`` through the plugin's moves, the gather
  with SGLang's read step (tests/support/sglang_env.py).

A check's cost is the engine's own move, the comparison and one all-reduce of a flag (plus, for a sum, one more
reduce-scatter for the bound); it is paid on the first N calls of each kind in a process only. CPU host time
says nothing about a GPU, where the engine's move runs on the device and the flag's read syncs the host.

    python3 scripts/first_use_cost.py --engine vllm --world 2 --rounds 20
    python3 scripts/first_use_cost.py --engine sglang --world 2 --rounds 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))

METHODS = ("own", "nsa_cp", "checked")


def _timed(fn, dist):
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _vllm(rank, world, args):
    import torch
    import torch.distributed as dist

    import vllm_env

    vllm_env.prepare_process()
    config, pcp = vllm_env.setup_parallel(rank, world)
    vllm_env.cuda_like_gather(pcp)
    import vllm.model_executor.layers.fused_moe.utils as moe_utils
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    import nsa_cp.integrations.vllm as nsa_vllm
    from nsa_cp.integrations.vllm import check

    from vllm.model_executor.layers.quantization.utils import fp8_utils

    moe_utils.per_token_group_quant_fp8 = partial(vllm_env.cuda_group_quant, use_ue8m0=True)  # CUDA arithmetic
    fp8_utils.is_deep_gemm_e8m0_used = lambda: True  # Blackwell's default: UE8M0 scales
    runner = vllm_env.runner(world, quant_config=None if args.bf16 else vllm_env.trtllm_quant_config())
    nsa_vllm.install()
    local = vllm_env.partition(vllm_env.manager(rank, world, max_num_tokens=8192), args.lens, [True] * len(args.lens))
    m = local.num_tokens_after_padding
    h = torch.randn(m, args.hidden).bfloat16()
    logits = torch.randn(m, 8)
    own_dispatch, own_combine = MoERunner._maybe_dispatch._nsa_cp_original, MoERunner._maybe_combine._nsa_cp_original
    times = {(mv, me): [] for mv in ("dispatch", "combine") for me in METHODS}
    for r in range(args.rounds + 1):
        for method in METHODS:
            os.environ["NSA_CP_FIRST_USE_CHECKS"] = "0" if method == "nsa_cp" else "1"
            check.CHECKS.reset()
            with set_forward_context(None, config, is_padding=local.is_padding):
                out = []
                d = own_dispatch if method == "own" else MoERunner._maybe_dispatch
                c = own_combine if method == "own" else MoERunner._maybe_combine
                t_d = _timed(lambda: out.append(d(runner, h, logits)), dist)
                q = out[0][0]
                partials = (q.float() if q.element_size() > 1 else q.view(torch.uint8).float()).bfloat16()
                t_c = _timed(lambda: c(runner, None, partials), dist)
            if r:  # the first round warms up
                times["dispatch", method].append(t_d)
                times["combine", method].append(t_c)
    assert not check.CHECKS.declined, check.CHECKS.declined
    return times, m


def _sglang(rank, world, args):
    import torch
    import torch.distributed as dist

    import sglang_env

    sglang_env.setup_parallel(rank, world)
    import nsa_cp
    import nsa_cp.integrations.sglang as nsa_sglang
    from nsa_cp.integrations.sglang import plugin, state

    md, _ = sglang_env.build_metadata(args.lens, world, "zigzag")
    rows = md.per_rank_actual_token[0]
    theirs = sglang_env.sglang_moves()
    ours = plugin._moves_on(theirs, lambda: nsa_sglang.CpMovesAdapter(compact=False), compact_ok=True)
    step, fb = sglang_env.read_step(), type("FB", (), {"attn_cp_metadata": md})()
    norm = nsa_cp.RMSNorm(args.hidden).to(torch.bfloat16)
    hs, res = torch.randn(rows, args.hidden).bfloat16(), torch.randn(rows, args.hidden).bfloat16()
    full = torch.randn(rows * world, args.hidden).bfloat16()
    times = {(mv, me): [] for mv in ("gather", "take_back", "reduce_scatter") for me in METHODS}
    with torch.no_grad():
        for r in range(args.rounds + 1):
            for method in METHODS:
                os.environ["NSA_CP_FIRST_USE_CHECKS"] = "0" if method == "nsa_cp" else "1"
                state.CHECKS.reset()
                moves = theirs if method == "own" else ours
                a, b, p = hs.clone(), res.clone(), full.clone()
                t = {"gather": _timed(lambda: partial(moves.gather, gather=step)(a, b, fb, norm), dist),
                     "take_back": _timed(lambda: moves.take_back(full, res, fb), dist),
                     "reduce_scatter": _timed(lambda: moves.reduce_scatter(p, res, fb), dist)}
                if r:
                    for mv, v in t.items():
                        times[mv, method].append(v)
    assert not state.CHECKS.declined, state.CHECKS.declined
    return times, rows


def _rank(rank, world, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    times, m = (_vllm if args.engine == "vllm" else _sglang)(rank, world, args)
    med = torch.tensor([statistics.median(v) for v in times.values()], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        keys = list(times)
        per = {k: float(v) * 1e3 for k, v in zip(keys, med)}
        print(f"{args.engine}, world {world}, {m} rows per rank (lens {args.lens}), H {args.hidden}"
              f"{' bf16' if args.bf16 else ''}: host ms per call, median of {args.rounds} rounds, max over ranks\n")
        print("| move | engine's own | nsa_cp | nsa_cp, checked | the check's cost |\n|---|---|---|---|---|")
        for mv in dict.fromkeys(k[0] for k in keys):
            own, ns, ch = (per[mv, me] for me in METHODS)
            print(f"| {mv} | {own:.3f} | {ns:.3f} | {ch:.3f} | {ch - ns:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--lens", type=int, nargs="+", default=[1000, 24, 1, 1])
    parser.add_argument("--bf16", action="store_true", help="vLLM: unquantized experts (bf16 over the gather)")
    args = parser.parse_args()
    from dist_harness import run_world

    results = run_world(args.world, "gloo", _entry, args, timeout_s=1800)
    for result in results:
        if result.get("error"):
            raise SystemExit(result["error"])


def _entry(rank, world, args):
    import traceback

    try:
        _rank(rank, world, args)
        return {"error": None}
    except Exception:  # noqa: BLE001  the rank's traceback, printed by main
        return {"error": traceback.format_exc()}


if __name__ == "__main__":
    main()
