"""Host cost of the P2P path's Python layers on a CPU machine: public call -> request -> plan -> the P2P
transport's runner, with the native launches stubbed out.

    PYTHONPATH=TREE python scripts/p2p_host_layers.py [--rounds 3000]    # TREE: a checkout with nsa_cp/

Per public call on the P2P backend: host microseconds (median of ``--rounds`` interleaved rounds) and
Python function calls (``sys.setprofile`` "call" and "c_call" events). The transport is the tree's own
``P2PTransport`` runner code over a stub native state (every launch returns at once) and CPU buffers,
so what is timed is nsa_cp's Python and nothing of the GPU: two trees compare here without the noise of
ranks sharing a GPU (scripts/host_overhead_ab.sh measures the whole call on one). One rank of a gloo
group; the layout is made uneven by ``align``. Run from anywhere: the script's own folder holds no
nsa_cp, so ``PYTHONPATH`` picks the tree. Also reads trees from before ``nsa_cp/transport/p2p/``.
"""

import argparse
import functools
import importlib
import os
import sys
import tempfile
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from harness import interleaved_medians_us, python_calls  # noqa: E402 - the benchmarks' harness, beside this script's folder

M, H = 256, 512  # small rows: the out= copies, real memcpys on a CPU, stay small beside the layers timed


class _StubState:
    """The native P2PState's surface that the runners call; every launch enqueues nothing."""

    closed = False

    def gather(self, *args):
        return 0

    def norm_gather(self, *args):
        return 0

    def reduce_scatter(self, *args):
        return None

    def reduce_scatter_norm(self, *args):
        return None

    def scale_offset(self, buffer):
        return 0

    def error(self):
        return [0]


class _StubNative:
    class P2PDeviceError(RuntimeError):
        pass

    QUANT_FP8_E4M3_G128 = 1


def _stub_transport(nsa_cp, layout):
    """The tree's P2PTransport, not constructed (no GPU, no rendezvous): its runner code over CPU buffers."""
    try:
        module = importlib.import_module("nsa_cp.transport.p2p.transport")
    except ImportError:  # a tree from before the transport package
        module = importlib.import_module("nsa_cp.transport.p2p_transport")
    cls = module.P2PTransport
    transport = cls.__new__(cls)
    gathers = [torch.empty(layout.padded_len, H, dtype=torch.bfloat16) for _ in range(2)]
    reduce = torch.empty(layout.padded_len, H, dtype=torch.bfloat16)

    # transport/p2p/buffers.py's P2PBuffers, as far as the runners read it
    buffers = types.SimpleNamespace(gathers=gathers, reduce=reduce, hidden_size=H, close=lambda: None)
    for view in ("rows_view", "quant_views"):  # trees where the buffers hand out their views: the real methods
        method = getattr(getattr(module, "P2PBuffers", None), view, None)
        if method is not None:
            setattr(buffers, view, functools.partial(method, buffers))
    fields = dict(_broken=None, _C=_StubNative, _state=_StubState(), group=None, rank=0, world=1,
                  device=torch.device("cpu"), max_tokens_per_rank=M, hidden_size=H, dtype=torch.bfloat16,
                  double_buffer_tokens=M, _gathers=gathers, _elem=2, _row_bytes=2 * H, _stream=lambda index: 0,
                  _reduce_views={}, _buffers=buffers, timeout_ns=10 ** 9,
                  _codes={torch.bfloat16: 0, torch.float16: 1, torch.float32: 2},  # nsa_cp._C's DTYPE_* codes
                  _reduce=reduce)  # _reduce: the reduce buffer of trees before transport/p2p/
    if callable(getattr(cls, "_buffers", None)):  # older trees: a method of that name
        fields.pop("_buffers")
    for name, value in fields.items():
        setattr(transport, name, value)
    support = importlib.import_module("nsa_cp.support").Support
    cls.support = lambda self, *args, **kwargs: support.yes()  # a CPU device: the real verdict says no
    cls.close = lambda self: None
    return transport


def rows(nsa_cp):
    """``{name: call}``: the public P2P calls of benchmarks/host_overhead.py, on one rank."""
    from nsa_cp.planning import plan

    layout = nsa_cp.ShardLayout([int(M * 0.8)], align=M)
    transport = _stub_transport(nsa_cp, layout)
    finder = plan.p2p if hasattr(plan, "p2p") else None  # a tree from before the transport seam
    for where in ("nsa_cp.transport.p2p.registry", "nsa_cp.transport.p2p.routes"):  # its P2P provider, newest first
        try:
            module = importlib.import_module(where)
        except ImportError:
            continue
        if hasattr(module, "PROVIDER"):
            finder = module
            break
    finder.get_p2p = lambda group=None: transport
    finder.any_registered = lambda: True
    n, bf16, p2p = layout.per_rank_actual_token[0], torch.bfloat16, "p2p"
    x, res, w = torch.randn(n, H, dtype=bf16), torch.randn(n, H, dtype=bf16), torch.ones(H, dtype=bf16)
    out_pad = torch.empty(layout.padded_len, H, dtype=bf16)
    out_cmp = torch.empty(layout.total_len, H, dtype=bf16)
    rs_out = torch.empty(M, H, dtype=bf16)[:n]
    buf_p = nsa_cp.cp_reduce_scatter_buffer(x, layout, backend=p2p)
    buf_c = nsa_cp.cp_reduce_scatter_buffer(x, layout, compact=True, backend=p2p)
    return {
        "cp_all_gather padded": lambda: nsa_cp.cp_all_gather(x, layout, backend=p2p),
        "cp_all_gather padded, out=": lambda: nsa_cp.cp_all_gather(x, layout, out=out_pad, backend=p2p),
        "cp_all_gather compact": lambda: nsa_cp.cp_all_gather(x, layout, compact=True, backend=p2p),
        "cp_all_gather compact, out=": lambda: nsa_cp.cp_all_gather(x, layout, compact=True, out=out_cmp,
                                                                    backend=p2p),
        "cp_reduce_scatter padded, out=": lambda: nsa_cp.cp_reduce_scatter(buf_p, layout, out=rs_out, backend=p2p),
        "cp_reduce_scatter compact, out=": lambda: nsa_cp.cp_reduce_scatter(buf_c, layout, compact=True,
                                                                            out=rs_out, backend=p2p),
        "fused_add_rmsnorm_all_gather padded": lambda: nsa_cp.fused_add_rmsnorm_all_gather(
            x, res, w, 1e-6, layout, backend=p2p),
        "reduce_scatter_fused_add_rmsnorm padded": lambda: nsa_cp.reduce_scatter_fused_add_rmsnorm(
            buf_p, res, w, 1e-6, layout, backend=p2p),
        "floor: x.new_empty([P*M, H])": lambda: x.new_empty((layout.padded_len, H)),
    }


def measure(rounds: int):
    """``{name: (median host us, Python calls)}`` in a gloo group of one rank (made here when none is)."""
    made = not dist.is_initialized()
    if made:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        import nsa_cp

        calls = rows(nsa_cp)
        for fn in calls.values():  # plans built, views cached
            for _ in range(20):
                fn()
        us = interleaved_medians_us(calls, rounds)
        return {name: (us[name], python_calls(fn)) for name, fn in calls.items()}
    finally:
        if made:
            dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    result = measure(args.rounds)
    import nsa_cp

    print(f"P2P path, native launches stubbed, CPU; host us per call (median of {args.rounds} interleaved "
          f"rounds) and Python calls per call; nsa_cp from {os.path.dirname(os.path.dirname(nsa_cp.__file__))}")
    for name, (us, calls) in result.items():
        print(f"  {name:<48}{us:9.2f}   {calls:6.1f} py calls")


if __name__ == "__main__":
    main()
