"""The P2P transport's routes (nsa_cp/transport/p2p/routes.py, the base P2PTransport answers the planner
from) as the planner takes them, on CPU with a recording stand-in for the P2PTransport (the same base over
recording runners, registered through the transport seam in place of the real provider): which runner each plan builds, what it hands it, ``out=`` copied from the
transport's buffer, an unaligned residual staged through an aligned copy and written back, and the
reduce-scatter's runner called without a frame of its own. The transport itself runs on GPUs
(tests/transports/test_p2p_gpu.py); this pins the layer between it and the public functions."""

import pytest
import torch

import nsa_cp
from nsa_cp.planning import plan
from nsa_cp.planning.request import Request
from nsa_cp.support import Support
from nsa_cp.transport import base
from nsa_cp.transport.p2p.routes import P2PRoutes

H = 256


class FakeTransport(P2PRoutes):
    """Records the runners asked for and every call; a gather returns a fresh 'buffer view' of ones. The
    planner's runners come ``checked=True`` (one verdict: ``serves``), which ``unchecked`` records otherwise."""

    def __init__(self):
        self.calls, self.verdicts, self.unchecked = [], 0, 0

    def support(self, *args, **kwargs):
        self.verdicts += 1
        return Support.yes()

    def gather_runner(self, layout, compact, row_shape, quant=None, ordered=False, checked=False):
        self.unchecked += not checked
        rows = layout.total_len if ordered else layout.global_len(compact)

        def run(x, dc=None, pos=None):
            self.calls.append(("gather", x, dc, pos))
            full = torch.ones(rows, *row_shape)
            return full if quant is None else (full, torch.ones(rows, row_shape[-1] // 128))
        return run

    def norm_gather_runner(self, layout, compact, row_shape, quant=None, ordered=False, checked=False):
        self.unchecked += not checked

        def run(x, residual, weight, eps, dc=None, pos=None):
            self.calls.append(("norm_gather", residual, weight, eps))
            if residual is not None:
                residual.add_(1)
            full = torch.ones(layout.global_len(compact), *row_shape)
            return full if quant is None else (full, torch.ones(full.shape[0], row_shape[-1] // 128))
        return run

    def reduce_scatter_runner(self, layout, compact, row_shape, ordered=False, norm=False, checked=False):
        self.unchecked += not checked
        if norm:
            def run_norm(y, residual, weight, eps, out=None, dc=None, pos=None):
                self.calls.append(("scatter_norm", residual))
                residual.add_(1)
                return torch.zeros(layout.count(0), *row_shape), residual
            return run_norm

        def run(y, out=None, dc=None, pos=None):
            self.calls.append(("scatter", out, dc, pos))
            return torch.zeros(layout.count(0), *row_shape) if out is None else out
        return run


class FakeGroup:
    def rank(self):
        return 0

    def size(self):
        return 2


LAYOUT = nsa_cp.ShardLayout([5, 3])
CUDA = torch.device("cuda", 0)  # what the plan is told; every tensor here is on the CPU


def _req(op, quant=None, has_out=False, residual=False):
    return Request(op, LAYOUT, None, False, "auto", "p2p", quant, torch.Size([H]), torch.bfloat16, CUDA, has_out,
                   False, False, residual)


@pytest.fixture
def fake(monkeypatch):
    transport = FakeTransport()

    class FakeProvider:
        name = "p2p"

        def open(self, req, group):
            return transport

    base.register(FakeProvider())  # asked before the table's P2P row
    yield transport
    base.unregister("p2p")


def test_plain_gather_hands_the_transport_view_back(fake):
    p = plan.GatherPlan(_req("cp_all_gather"), FakeGroup())
    assert (p.backend, p.algo) == ("p2p", "padded")
    x = torch.randn(5, H)
    got = p.run(x, None, None, None, None)
    assert fake.calls == [("gather", x, None, None)] and torch.equal(got, torch.ones(LAYOUT.padded_len, H))


def test_out_is_filled_from_the_transport_buffer(fake):
    p = plan.GatherPlan(_req("cp_all_gather", has_out=True), FakeGroup())
    out = torch.full((LAYOUT.padded_len, H), float("nan"))
    assert p.run(torch.randn(5, H), out, None, None, None) is out and torch.equal(out, torch.ones_like(out))


def test_fp8_gather_returns_the_pair(fake):
    p = plan.GatherPlan(_req("cp_all_gather", quant="fp8_e4m3_g128"), FakeGroup())
    q, scale = p.run(torch.randn(5, H), None, None, None, None)
    assert q.shape == (LAYOUT.padded_len, H) and scale.shape == (LAYOUT.padded_len, H // 128)


def test_norm_gather_stages_an_unaligned_residual(fake):
    p = plan.GatherPlan(_req("fused_add_rmsnorm_all_gather", residual=True), FakeGroup())
    base = torch.zeros(5 * H + 1)
    residual = base[1:].view(5, H)  # 4 bytes past an aligned start: the fused kernels cannot update it in place
    weight = torch.ones(H)
    p.run(torch.randn(5, H), None, None, None, (residual, weight, 1e-6))
    (kind, passed, w, eps), = fake.calls
    assert kind == "norm_gather" and passed is not residual and passed.data_ptr() % 16 == 0
    assert w is weight and eps == 1e-6
    assert torch.equal(residual, torch.ones(5, H)), "the staged residual was not written back"


def test_norm_gather_passes_an_aligned_residual_itself(fake):
    p = plan.GatherPlan(_req("fused_add_rmsnorm_all_gather", residual=True), FakeGroup())
    residual = torch.zeros(5, H)
    p.run(torch.randn(5, H), None, None, None, (residual, torch.ones(H), 1e-6))
    assert fake.calls[0][1] is residual and torch.equal(residual, torch.ones(5, H))


def test_reduce_scatter_calls_the_transport_runner_itself(fake):
    p = plan.ScatterPlan(_req("cp_reduce_scatter"), FakeGroup())
    assert p._runner.__qualname__.startswith("FakeTransport.")  # no adapter frame in between
    out = torch.empty(5, H)
    assert p.run(torch.randn(LAYOUT.padded_len, H), out, None, None, None) is out
    assert fake.calls == [("scatter", out, None, None)]


def test_fused_reduce_scatter_stages_an_unaligned_residual(fake):
    p = plan.ScatterPlan(_req("reduce_scatter_fused_add_rmsnorm", residual=True), FakeGroup())
    base = torch.zeros(5 * H + 1)
    residual = base[1:].view(5, H)
    y, _ = p.run(torch.randn(LAYOUT.padded_len, H), None, None, None, (residual, torch.ones(H), 1e-6))
    assert fake.calls[0][0] == "scatter_norm" and fake.calls[0][1] is not residual
    assert y.shape == (5, H) and torch.equal(residual, torch.ones(5, H))


def test_fused_reduce_scatter_passes_an_aligned_residual_itself(fake):
    p = plan.ScatterPlan(_req("reduce_scatter_fused_add_rmsnorm", residual=True), FakeGroup())
    residual = torch.zeros(5, H)
    y, back = p.run(torch.randn(LAYOUT.padded_len, H), None, None, None, (residual, torch.ones(H), 1e-6))
    assert fake.calls == [("scatter_norm", residual)] and back is residual
    assert torch.equal(residual, torch.ones(5, H))


@pytest.mark.parametrize("op, plan_type, residual", [
    ("cp_all_gather", plan.GatherPlan, False), ("fused_add_rmsnorm_all_gather", plan.GatherPlan, True),
    ("cp_reduce_scatter", plan.ScatterPlan, False), ("reduce_scatter_fused_add_rmsnorm", plan.ScatterPlan, True),
])
def test_one_verdict_per_plan_and_the_runner_not_checked_again(fake, op, plan_type, residual):
    p = plan_type(_req(op, residual=residual), FakeGroup())
    assert p.backend == "p2p"
    assert (fake.verdicts, fake.unchecked) == (1, 0), "the planner's runner re-checked what serves() said"


def test_the_real_provider_hands_the_transport_itself():
    from nsa_cp.transport.p2p import registry
    from nsa_cp.transport.p2p.transport import P2PTransport

    assert issubclass(P2PTransport, P2PRoutes)  # one object answers the planner: no adapter around it
    transport = FakeTransport()
    key = object()
    registry._REGISTRY.put(key, transport)
    try:
        req = Request("cp_all_gather", LAYOUT, key, False, "auto", "p2p", None, torch.Size([H]), torch.bfloat16, CUDA,
                      False, False, False, False)
        assert registry.PROVIDER.open(req, FakeGroup()) is transport
    finally:
        registry._REGISTRY.pop(key)
