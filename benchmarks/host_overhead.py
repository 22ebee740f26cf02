"""Host cost of one public call (Python + launches), and where it goes: a cProfile of the slow ones.

    python benchmarks/host_overhead.py [--M 256] [--calls 300] [--profile 25] [--shared-gpu N]

Public calls only (the plan/transport internals move; this script should not): per call, host
microseconds (perf_counter), median of ``--calls`` rounds that call every row once in turn (so drift of
the machine reaches every row alike; the GPU is synced every 5 rounds, outside the timed calls):

* floors: ``torch.compiler.is_compiling()``, ``x.new_empty([P*M, H])``, one ``torch.mul`` launch;
* the plain collectives (``all_gather_into_tensor`` of a full ``[M, H]``, ``F.pad`` + all-gather,
  ``reduce_scatter_tensor``);
* nsa_cp on NCCL (``backend="nccl"``): ``cp_all_gather`` / ``cp_reduce_scatter`` padded and compact,
  ``fused_add_rmsnorm_all_gather`` / ``reduce_scatter_fused_add_rmsnorm`` padded; after ``init_nccl``
  (where it works) through nsa_cp's own NCCL communicator ("NCCL native") and through torch's process
  group ("NCCL torch", ``NSA_CP_NCCL_CALL=direct`` set around each call);
* with 2+ GPUs and a P2P transport (``init_p2p``): the same with ``backend="auto"``, the reduce-scatters
  on the buffer ``cp_reduce_scatter_buffer`` hands out.

``--shared-gpu N`` (one GPU): N ranks share it over a gloo group, the P2P transport mapping them through
CUDA IPC; the rows are the floors and the P2P ones (no NCCL between ranks of one GPU). Host time per
call is each rank's own, but the ranks share the host's cores and the GPU: compare rows of one run.

Last column: Python function calls per public call (``sys.setprofile`` "call" and "c_call" events,
mean of 5 calls after the timing): a count, not a time, so two library trees compare on it without
the noise of the host (scripts/host_overhead_ab.sh).

The first row is timed again last: two identical rows differ by the noise of the run. Then a cProfile
(cumulative, ``--profile`` entries) of the uneven padded gather on NCCL and on P2P. Counts [M, 0.8M] on
2 GPUs; with one GPU the group has one rank and the layout is made uneven by ``align`` padding (no P2P).
Numbers are host microseconds, not device time (gather_scatter.py's ``host ms`` column is the same
quantity inside its interleaved rounds).
"""

import argparse
import cProfile
import io
import os
import pstats
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import harness
from harness import init_nccl_rank, keep_multicast_off, spawn_ranks, with_env

_AG, _RS = harness.all_gather_single, harness.reduce_scatter_single


def profile(fn, calls, top):
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 20 == 19:
            torch.cuda.synchronize()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()[-7000:]


def worker(rank, world, args):
    shared = args.shared_gpu is not None
    if shared:  # ranks sharing cuda:0: gloo for control, P2P over CUDA IPC for data
        keep_multicast_off()
        os.environ.setdefault("NSA_CP_P2P_MEMORY", "cuda_ipc")
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", store=dist.FileStore(args.store, world), rank=rank, world_size=world)
    else:
        init_nccl_rank(rank, world, args.store)
    torch.set_grad_enabled(False)
    import nsa_cp

    m, h, eps = args.M, 7168, 1e-6
    if world == 1:
        counts, layout = [int(m * 0.8)], nsa_cp.ShardLayout([int(m * 0.8)], align=m)
    else:
        counts = [m, int(m * 0.8)] + [m] * (world - 2)
        layout = nsa_cp.ShardLayout(counts)
    n, dev, bf16 = counts[rank], torch.device("cuda", 0 if shared else rank), torch.bfloat16
    x = torch.randn(n, h, device=dev, dtype=bf16)
    res = torch.randn(n, h, device=dev, dtype=bf16)
    w = torch.ones(h, device=dev, dtype=bf16)
    x_full = torch.randn(m, h, device=dev, dtype=bf16)
    out_pad = torch.empty(layout.padded_len, h, device=dev, dtype=bf16)
    out_cmp = torch.empty(layout.total_len, h, device=dev, dtype=bf16)
    y_pad = torch.randn(layout.padded_len, h, device=dev, dtype=bf16)
    y_cmp = torch.randn(layout.total_len, h, device=dev, dtype=bf16)
    rs_full = torch.empty(m, h, device=dev, dtype=bf16)
    rs_out = rs_full[:n]
    has_fused = hasattr(nsa_cp, "fused_add_rmsnorm_all_gather")

    def rows_for(backend, tag):
        r = {
            f"{tag}: cp_all_gather padded": lambda: nsa_cp.cp_all_gather(x, layout, backend=backend),
            f"{tag}: cp_all_gather padded, out=": lambda: nsa_cp.cp_all_gather(x, layout, out=out_pad, backend=backend),
            f"{tag}: cp_all_gather compact": lambda: nsa_cp.cp_all_gather(x, layout, compact=True, backend=backend),
            f"{tag}: cp_all_gather compact, out=": lambda: nsa_cp.cp_all_gather(x, layout, compact=True, out=out_cmp,
                                                                               backend=backend),
        }
        if backend == "auto" and hasattr(nsa_cp, "cp_reduce_scatter_buffer"):
            buf_p = nsa_cp.cp_reduce_scatter_buffer(x, layout, backend=backend)
            buf_c = nsa_cp.cp_reduce_scatter_buffer(x, layout, compact=True, backend=backend)
            buf_p.copy_(y_pad)
            buf_c.copy_(y_cmp)
        else:
            buf_p, buf_c = y_pad, y_cmp
        r[f"{tag}: cp_reduce_scatter padded, out="] = lambda: nsa_cp.cp_reduce_scatter(buf_p, layout, out=rs_out,
                                                                                        backend=backend)
        r[f"{tag}: cp_reduce_scatter compact, out="] = lambda: nsa_cp.cp_reduce_scatter(
            buf_c, layout, compact=True, out=rs_out, backend=backend)
        if has_fused:
            r[f"{tag}: fused_add_rmsnorm_all_gather padded"] = lambda: nsa_cp.fused_add_rmsnorm_all_gather(
                x, res, w, eps, layout, backend=backend)
            r[f"{tag}: reduce_scatter_fused_add_rmsnorm padded"] = lambda: nsa_cp.reduce_scatter_fused_add_rmsnorm(
                buf_p, res, w, eps, layout, backend=backend)
        return r

    first = ("plain all_gather_into_tensor", lambda: _AG(out_pad, x_full))
    if shared:
        first = ("floor: one torch.mul launch", lambda: torch.mul(x, 2.0))
    rows = dict([first])
    if not shared:
        rows.update({
            "F.pad + all_gather_into_tensor": lambda: _AG(out_pad, F.pad(x, (0, 0, 0, m - n))),
            "plain reduce_scatter_tensor": lambda: _RS(rs_full, y_pad),
        })
    rows.update({
        "floor: torch.compiler.is_compiling": torch.compiler.is_compiling,
        "floor: x.new_empty([P*M, H])": lambda: x.new_empty((layout.padded_len, h)),
        "floor: one torch.mul launch": lambda: torch.mul(x, 2.0),
    })
    native_note = None
    if shared:
        native_note = "ranks sharing one GPU: P2P rows only"
    elif hasattr(nsa_cp, "init_nccl") and not nsa_cp.nccl_unavailable_reason(None):
        nsa_cp.init_nccl(None, dev)
        rows.update(rows_for("nccl", "NCCL native"))  # nsa_cp's own NCCL communicator (the default after it)
        # the same calls through torch's process group: NSA_CP_NCCL_CALL=direct, set around each call
        # (~1 us of the row's time)
        for name, fn in rows_for("nccl", "NCCL torch").items():
            rows[name] = with_env(fn, "NSA_CP_NCCL_CALL", "direct")
    else:
        native_note = "no native NCCL rows: " + (nsa_cp.nccl_unavailable_reason(None)
                                                 if hasattr(nsa_cp, "init_nccl") else "no nsa_cp.init_nccl")
        rows.update(rows_for("nccl", "NCCL"))
    p2p_note = None
    if world >= 2:
        try:
            nsa_cp.init_p2p(None, m, h, bf16)
            rows.update(rows_for("auto", "P2P"))
        except Exception as e:  # noqa: BLE001 - the NCCL rows stand; say why there are no P2P rows
            p2p_note = f"no P2P rows: init_p2p raised {type(e).__name__}: {e}"
    rows[first[0] + " (again)"] = first[1]
    for fn in rows.values():  # warm-up: plans, kernels, communicators
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    us = harness.interleaved_medians_us(rows, args.calls, sync=torch.cuda.synchronize)
    py_calls = {name: harness.python_calls(fn) for name, fn in rows.items()}
    torch.cuda.synchronize()
    stats = torch.tensor(list(us.values()), dtype=torch.float64, device="cpu" if shared else dev)  # gloo: host
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    prof_nccl = None if shared else profile(lambda: nsa_cp.cp_all_gather(x, layout, backend="nccl"), args.calls,
                                            args.profile)
    prof_p2p = None
    if p2p_note is None and world >= 2:
        prof_p2p = profile(lambda: nsa_cp.cp_all_gather(x, layout, backend="auto"), args.calls, args.profile)
    if rank == 0:
        print(f"host microseconds per call, median of {args.calls} interleaved rounds, max over {world} rank(s); "
              f"M={m}, H={h}, bf16, {layout}")
        vals = dict(zip(us, stats.tolist()))
        base_ag, base_rs = vals.get("plain all_gather_into_tensor"), vals.get("plain reduce_scatter_tensor")
        for name, v in vals.items():
            base = base_rs if "reduce_scatter" in name else base_ag if "gather" in name else None
            ratio = f"   {v / base:5.2f}x the plain collective" if base else " " * 29
            print(f"  {name:<48}{v:9.1f}{ratio}   {py_calls[name]:6.1f} py calls")
        for note in (native_note, p2p_note):
            if note:
                print(f"  ({note})")
        if prof_nccl:
            print("\ncProfile, cp_all_gather padded uneven, backend nccl:")
            print(prof_nccl)
        if prof_p2p:
            print("cProfile, cp_all_gather padded uneven, backend auto (P2P):")
            print(prof_p2p)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--M", type=int, default=256)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--profile", type=int, default=25, help="cProfile entries printed per profile")
    parser.add_argument("--shared-gpu", type=int, metavar="N", default=None,
                        help="N ranks (2-8) sharing one GPU over gloo, P2P rows (the P2P path on a one-GPU machine)")
    args = parser.parse_args()
    if args.shared_gpu is None:
        spawn_ranks(worker, args, "host_overhead.py", min_gpus=1)
        return
    if not torch.cuda.is_available() or not 2 <= args.shared_gpu <= 8:
        raise SystemExit(f"--shared-gpu {args.shared_gpu}: needs a CUDA GPU and 2 to 8 ranks")
    args.store = os.path.join(tempfile.mkdtemp(), "store")
    harness.spawn(worker, args.shared_gpu, (args,), what="host_overhead.py")


if __name__ == "__main__":
    harness.run_main(main)
