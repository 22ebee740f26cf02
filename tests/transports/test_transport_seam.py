"""The transport seam (nsa_cp/transport/base.py): a transport written outside nsa_cp
(tests/support/loopback_transport.py) joins with one registration line, or as one row of the transport table
(nsa_cp/transports.py), and the public calls run through it.

On gloo, worlds 2 and 3, an uneven layout with a zero-token rank: every public call (plain, compact,
ordered gathers; FP8; the fused add + RMSNorm gather; reduce-scatters, the fused one, the buffer) under
``backend="auto"`` reaches the loopback transport (its record), and its results equal nsa_cp's own
torch.distributed path exactly (moves) or against float64 (sums); ``backend="loopback"`` insists and a
refusal (device counts) is the ValueError naming the transport; even layouts keep torch's collective;
unregistering restores the torch.distributed path and drops the cached plans."""

from __future__ import annotations

import traceback

import pytest

from dist_harness import case_failures, run_world


def _calls(nsa_cp, torch, layout, group, rank, seed):
    """Every public call on this rank's inputs (seeded, the same whatever the transport): a dict of results."""
    g = torch.Generator().manual_seed(seed + rank)
    n, h = layout.count(rank), 256
    x = torch.randn(n, h, generator=g).bfloat16()
    res = torch.randn(n, h, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    positions = torch.randperm(layout.total_len, generator=torch.Generator().manual_seed(seed))
    out = {"gather": nsa_cp.cp_all_gather(x, layout, group),
           "compact": nsa_cp.cp_all_gather(x, layout, group, compact=True),
           "ordered": nsa_cp.cp_all_gather(x, layout, group, positions=positions),
           "fp8": nsa_cp.cp_all_gather(x, layout, group, quant="fp8_e4m3_g128")}
    r = res.clone()
    out["norm"] = (nsa_cp.fused_add_rmsnorm_all_gather(x, r, w, 1e-6, layout, group), r)
    y = torch.randn(layout.padded_len, h, generator=g).bfloat16()
    out["scatter"] = nsa_cp.cp_reduce_scatter(y, layout, group)
    yc = torch.randn(layout.total_len, h, generator=g).bfloat16()
    out["scatter_compact"] = nsa_cp.cp_reduce_scatter(yc, layout, group, compact=True)
    r = res.clone()
    out["scatter_norm"] = nsa_cp.reduce_scatter_fused_add_rmsnorm(y, r, w, 1e-6, layout, group)
    buf = nsa_cp.cp_reduce_scatter_buffer(y, layout, group)
    buf.copy_(y)
    out["buffer"] = nsa_cp.cp_reduce_scatter(buf, layout, group)
    return out


def _same(torch, got, want, path=""):
    if isinstance(want, (tuple, list)):
        for i, (a, b) in enumerate(zip(got, want)):
            _same(torch, a, b, f"{path}[{i}]")
        return
    if "scatter" in path or "buffer" in path:
        # sums: gloo adds the bf16 partials with a rounding per add (2 at 3 ranks), the loopback rounds its
        # float64 sum once; a norm after the sum adds a rounding
        ok = torch.allclose(got.double(), want.double(), rtol=2 ** -6, atol=2 ** -6)
    else:
        ok = torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                         want.view(torch.uint8) if want.dtype.itemsize == 1 else want)
    assert got.shape == want.shape and ok, f"{path}: the loopback transport's result differs from nsa_cp's own"


def _worker(rank, world, payload):
    import torch

    import loopback_transport
    import nsa_cp
    from nsa_cp.transport import groups, register, unregister

    results = {}
    counts = [5, 0, 3][:world]
    layout = nsa_cp.ShardLayout(counts)
    try:
        own = _calls(nsa_cp, torch, layout, None, rank, 7)
        generation = groups.latest_generation()
        register(loopback_transport.LoopbackProvider())  # the one line
        assert groups.latest_generation() != generation, "registering kept the cached plans' generation"
        theirs = _calls(nsa_cp, torch, layout, None, rank, 7)
        for key in own:
            _same(torch, theirs[key][0] if key in ("scatter_norm",) else theirs[key],
                  own[key][0] if key in ("scatter_norm",) else own[key], key)
        ops = {op for op, _ in loopback_transport.CALLS}
        assert ops == {"cp_all_gather", "fused_add_rmsnorm_all_gather", "cp_reduce_scatter",
                       "reduce_scatter_fused_add_rmsnorm"}, ops
        stages = {st for _, st in loopback_transport.CALLS}
        assert {"copy", "norm", "fp8_e4m3_g128"} <= stages, stages
        results["auto"] = None
    except Exception:  # noqa: BLE001
        return {"auto": traceback.format_exc()}
    try:
        x = torch.randn(layout.count(rank), 256)
        before = len(loopback_transport.CALLS)
        nsa_cp.cp_all_gather(x, layout, backend="loopback")
        assert len(loopback_transport.CALLS) == before + 1
        even = nsa_cp.ShardLayout([4] * world)
        nsa_cp.cp_all_gather(torch.randn(4, 256), even)  # auto: the even layout keeps torch's collective
        assert len(loopback_transport.CALLS) == before + 1, "the even layout left torch's collective"
        counts_t, offsets_t = layout.device_tensors("cpu")
        try:
            nsa_cp.cp_all_gather(x, layout, backend="loopback", device_counts=(counts_t, offsets_t))
            raise AssertionError("a refused insisted call did not raise")
        except ValueError as err:
            assert "backend: 'loopback' cannot serve this call (x): the loopback transport reads host counts" in str(err)
        results["insist"] = None
    except Exception:  # noqa: BLE001
        results["insist"] = traceback.format_exc()
    try:
        unregister("loopback")
        before = len(loopback_transport.CALLS)
        again = _calls(nsa_cp, torch, layout, None, rank, 7)
        assert len(loopback_transport.CALLS) == before, "the unregistered transport still ran"
        assert torch.equal(again["gather"], own["gather"])
        try:
            nsa_cp.cp_all_gather(x, layout, backend="loopback")
            raise AssertionError("an unregistered backend was accepted")
        except ValueError as err:
            assert "backend: expected one of ('auto', 'nccl', 'p2p')" in str(err), str(err)
        results["unregister"] = None
    except Exception:  # noqa: BLE001
        results["unregister"] = traceback.format_exc()
    return results


def _table_worker(rank, world, payload):
    """The loopback transport as one row of nsa_cp/transports.py (its module: tests/support/loopback_transport.py),
    asked first: every public call reaches it with nsa_cp's own results; backend= names it."""
    import torch

    import loopback_transport
    import nsa_cp
    from nsa_cp import transports
    from nsa_cp.transport import base

    layout = nsa_cp.ShardLayout([5, 0, 3][:world])
    table = transports.TRANSPORTS
    try:
        transports.TRANSPORTS = (transports.TransportRow("loopback", "loopback_transport", "PROVIDER"), *table)
        theirs = _calls(nsa_cp, torch, layout, None, rank, 7)
        assert {st for _, st in loopback_transport.CALLS} >= {"copy", "norm", "fp8_e4m3_g128"}, loopback_transport.CALLS
        assert base.names() == ("auto", "loopback", "nccl", "p2p"), base.names()
        before = len(loopback_transport.CALLS)
        nsa_cp.cp_all_gather(torch.randn(layout.count(rank), 256), layout, backend="loopback")
        assert len(loopback_transport.CALLS) == before + 1
    except Exception:  # noqa: BLE001
        return {"table": traceback.format_exc()}
    finally:
        transports.TRANSPORTS = table
    try:
        base.unregister("none")  # a new registry generation: the table changed under cached plans
        own = _calls(nsa_cp, torch, layout, None, rank, 7)
        for key in own:
            _same(torch, theirs[key][0] if key in ("scatter_norm",) else theirs[key],
                  own[key][0] if key in ("scatter_norm",) else own[key], key)
        return {"table": None}
    except Exception:  # noqa: BLE001
        return {"table": traceback.format_exc()}


@pytest.mark.parametrize("world", [2, 3])
def test_a_transport_added_as_a_table_row_serves_the_public_calls(world):
    failures = case_failures(run_world(world, "gloo", _table_worker, None, timeout_s=600), "table")
    assert not failures, "\n".join(failures)


_WORLDS = {}


@pytest.mark.parametrize("world,case", [(w, c) for w in (2, 3) for c in ("auto", "insist", "unregister")])
def test_a_registered_transport_serves_the_public_calls(world, case):
    if world not in _WORLDS:
        _WORLDS[world] = run_world(world, "gloo", _worker, None, timeout_s=240)
    errors = case_failures(_WORLDS[world], case)
    assert not errors, "\n".join(errors)
