"""Which norms NSACPLayerCommunicator takes: RMSNorms exposing ``weight`` and an epsilon are fused (nsa_cp's,
SGLang / vLLM style, ``torch.nn.RMSNorm`` with its ``eps=None``), callables with the ``norm(x, residual)``
convention are called; anything else is refused at construction, saying what to pass.

The distributed runs (the README loop with ``torch.nn.RMSNorm``, bf16 and FP8) are in tests/package/test_readme_loop.py;
here the communicator runs with ``layout=None`` (CP off: its norms only, no process group needed).
"""

import pytest
import torch

import nsa_cp
from nsa_cp.api.communicator import norm_parameters

H = 256
F32_EPS = torch.finfo(torch.float32).eps


class RMSNorm(torch.nn.Module):
    """An SGLang / vLLM-style norm defined elsewhere: same class name, ``variance_epsilon``, ``(x, residual)``."""

    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x, residual=None):
        y, r = nsa_cp.rows.reference.fused_add_rmsnorm(x, residual, self.weight, self.variance_epsilon)
        return y if residual is None else (y, r)


class GemmaRMSNorm(torch.nn.Module):  # y = rmsnorm(x) * (1 + weight): must not be fused
    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x, residual=None):
        s = x if residual is None else x + residual
        y = nsa_cp.rows.reference.fused_add_rmsnorm(s, None, 1 + self.weight, self.variance_epsilon)[0]
        return y if residual is None else (y, s)


class TorchRMSNormChild(torch.nn.RMSNorm):
    pass


def _weighted(norm):
    with torch.no_grad():
        norm.weight.copy_(torch.rand(H, generator=torch.Generator().manual_seed(3)) + 0.5)
    return norm


def test_norm_parameters_of_torch_rmsnorm():
    norm = torch.nn.RMSNorm(H)
    weight, eps = norm_parameters(norm)
    assert weight is norm.weight and eps == F32_EPS  # torch.rms_norm's eps=None for bf16/fp16/fp32 inputs
    assert norm_parameters(torch.nn.RMSNorm(H, eps=1e-5))[1] == 1e-5
    assert norm_parameters(TorchRMSNormChild(H, eps=1e-4))[1] == 1e-4
    assert norm_parameters(torch.nn.RMSNorm(H, elementwise_affine=False)) == (None, F32_EPS)
    assert norm_parameters(torch.nn.RMSNorm((4, H))) is None  # not a row norm
    assert norm_parameters(RMSNorm(H, eps=1e-3))[1] == 1e-3
    assert norm_parameters(nsa_cp.RMSNorm(H, eps=2e-6))[1] == 2e-6
    assert norm_parameters(GemmaRMSNorm(H)) is None
    assert norm_parameters(torch.nn.LayerNorm(H)) is None


def test_torch_rmsnorm_eps_none_is_the_one_torch_adds():
    """Tiny rows, where the epsilon matters: torch's eps=None is fp32's machine epsilon, not bf16's."""
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(1)) * 1e-4
    norm = _weighted(torch.nn.RMSNorm(H))
    weight, eps = norm_parameters(norm)
    ours, _ = nsa_cp.rows.reference.fused_add_rmsnorm(x, None, weight, eps)
    torch.testing.assert_close(ours, norm(x).detach(), rtol=1e-6, atol=0)
    wrong, _ = nsa_cp.rows.reference.fused_add_rmsnorm(x, None, weight, torch.finfo(torch.bfloat16).eps)
    assert not torch.allclose(wrong, norm(x).detach(), rtol=1e-2)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("make", [lambda: torch.nn.RMSNorm(H, dtype=torch.bfloat16),
                                  lambda: torch.nn.RMSNorm(H, eps=1e-6, dtype=torch.bfloat16),
                                  lambda: TorchRMSNormChild(H, dtype=torch.bfloat16),
                                  lambda: RMSNorm(H).to(torch.bfloat16),
                                  lambda: nsa_cp.RMSNorm(H, dtype=torch.bfloat16)],
                         ids=["torch-eps-none", "torch-eps", "torch-subclass", "sglang-style", "nsa_cp"])
def test_accepted_norms_follow_the_convention(make, fuse):
    """prepare_attn / prepare_mlp with CP off: the add + norm of the convention, residual updated in place."""
    norm1, norm2 = _weighted(make()), _weighted(make())
    comm = nsa_cp.NSACPLayerCommunicator(None, norm1, norm2, fuse=fuse)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, H, generator=g).to(torch.bfloat16)
    residual = torch.randn(7, H, generator=g).to(torch.bfloat16)
    s = x.float() + residual.float()
    for step, norm in ((comm.prepare_attn, norm1), (comm.prepare_mlp, norm2)):
        res = residual.clone()
        y, out_res = step(x, res, None)
        assert out_res is res and torch.equal(res, s.to(torch.bfloat16)), "residual <- x + residual, in place"
        weight, eps = norm_parameters(norm)
        want = torch.nn.functional.rms_norm(s, (H,), weight.detach().float(), eps).to(torch.bfloat16)
        # fused: the fp32 sum is normed (the convention); unfused torch.nn.RMSNorm norms the rounded sum
        torch.testing.assert_close(y.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    y, r = comm.prepare_attn(x, None, None)  # a first layer: no residual, x is the residual
    assert r is x and y.shape == x.shape


@pytest.mark.parametrize("bad,why", [
    (torch.nn.LayerNorm(H), "LayerNorm \\(its call takes no residual\\)"),
    (torch.nn.RMSNorm((4, H)), "RMSNorm \\(its call takes no residual\\)"),
    (lambda x: x, "function \\(its call takes no residual\\)"),
    (3, "int \\(not callable\\)"),
])
def test_unusable_norms_are_refused_at_construction(bad, why):
    good = nsa_cp.RMSNorm(H)
    for args, name in (((bad, good), "input_layernorm"), ((good, bad), "post_attention_layernorm")):
        with pytest.raises(ValueError, match=rf"^{name}: expected an RMSNorm exposing `weight` and an epsilon .*"
                                             rf"norm\(x, residual\) -> \(y, residual\); got {why}$"):
            nsa_cp.NSACPLayerCommunicator(None, *args)


def test_callables_with_the_convention_are_called_not_fused():
    calls = []

    def passthrough(x, residual=None):
        calls.append(residual is not None)
        return x if residual is None else (x, residual)

    gemma = GemmaRMSNorm(H)
    comm = nsa_cp.NSACPLayerCommunicator(None, passthrough, gemma)
    assert comm._mlp_norm is None  # Gemma's 1 + weight is not the fused kernels' norm
    x, residual = torch.randn(3, H), torch.randn(3, H)
    comm.prepare_attn(x, residual, None)
    assert calls == [True]
    y, _ = comm.prepare_mlp(x, residual.clone(), None)
    torch.testing.assert_close(y, gemma(x, residual.clone())[0])
