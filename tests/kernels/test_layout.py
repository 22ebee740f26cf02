import os
import pickle

import pytest
import torch

import nsa_cp
from nsa_cp import envs


def test_attributes():
    layout = nsa_cp.ShardLayout(per_rank_actual_token=[3, 0, 5], align=4)
    assert layout.cp_size == 3
    assert layout.per_rank_actual_token == (3, 0, 5)
    assert layout.max_rank_len == 8
    assert layout.padded_len == 24
    assert layout.total_len == 8
    assert layout.offsets == (0, 3, 3)
    assert not layout.is_even
    assert layout.rows(2, compact=False) == (16, 21)
    assert layout.rows(2, compact=True) == (3, 8)


@pytest.mark.parametrize("counts,align,even", [([4, 4], 1, True), ([4, 4], 4, True), ([4, 4], 3, False),
                                               ([0, 0], 1, True), ([1, 0], 1, False), ([7], 1, True)])
def test_is_even(counts, align, even):
    layout = nsa_cp.ShardLayout(counts, align=align)
    assert layout.is_even is even
    if even:
        assert layout.padded_len == layout.total_len


def test_value_semantics():
    a = nsa_cp.ShardLayout([1, 2], align=2)
    b = nsa_cp.ShardLayout((1, 2), align=2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != nsa_cp.ShardLayout([1, 2], align=1)
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a._counts = (5, 5)
    with pytest.raises(AttributeError):
        a.max_rank_len = 3
    assert nsa_cp.ShardLayout(torch.tensor([2, 3])) == nsa_cp.ShardLayout([2, 3])


def test_device_tensors_cached_int32():
    layout = nsa_cp.ShardLayout([3, 0, 5])
    counts, offsets = layout.device_tensors("cpu")
    assert counts.dtype == torch.int32 and counts.tolist() == [3, 0, 5]
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 3]
    assert layout.device_tensors(torch.device("cpu"))[0] is counts


@pytest.mark.parametrize("counts,align,words", [
    ([3, -1], 1, ["per_rank_actual_token[1]", ">= 0", "-1"]),
    ([], 1, ["per_rank_actual_token", "empty"]),
    ([1.5], 1, ["per_rank_actual_token[0]", "1.5"]),
    ([True], 1, ["per_rank_actual_token[0]"]),
    ([2], 0, ["align", "0"]),
    ([2], 2.0, ["align"]),
])
def test_bad_layouts(counts, align, words):
    with pytest.raises(ValueError) as info:
        nsa_cp.ShardLayout(counts, align=align)
    for word in words:
        assert word in str(info.value)


def test_rmsnorm_convention():
    torch.manual_seed(0)
    norm = nsa_cp.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, r = torch.randn(5, 16), torch.randn(5, 16)
    ref = lambda t: (t.double() * torch.rsqrt(t.double().pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double())
    assert torch.allclose(norm(x).double(), ref(x), rtol=1e-6, atol=1e-6)
    r0 = r.clone()
    y, s = norm(x, r)
    assert s is r  # the residual is updated in place and returned
    assert torch.equal(s, (x.float() + r0.float()).to(x.dtype))
    assert torch.allclose(y.double(), ref(x + r0), rtol=1e-6, atol=1e-6)
    assert norm(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="x"):
        norm(torch.randn(2, 8))
    with pytest.raises(ValueError, match="residual"):
        norm(x, r[:2])


def test_envs(monkeypatch):
    monkeypatch.setenv("NSA_CP_COMPACT_ALGO", "coalesced")
    assert envs.NSA_CP_COMPACT_ALGO == "coalesced"
    monkeypatch.setenv("NSA_CP_COMPACT_ALGO", "fastest")
    with pytest.raises(ValueError, match="NSA_CP_COMPACT_ALGO"):
        envs.NSA_CP_COMPACT_ALGO
    monkeypatch.setenv("NSA_CP_COALESCED_GATHER_MIN_BYTES", "-3")
    with pytest.raises(ValueError, match="NSA_CP_COALESCED_GATHER_MIN_BYTES"):
        envs.NSA_CP_COALESCED_GATHER_MIN_BYTES
    assert all(name.startswith("NSA_CP_") for name in envs.ENVIRONMENT_VARIABLES)
    with pytest.raises(AttributeError):
        envs.NSA_CP_NOT_A_VARIABLE


def test_envs_follow_every_change_of_the_environment(monkeypatch):
    """Readers cache only the parse of an unchanged raw value: every set, change and unset is seen,
    through os.environ and monkeypatch alike, and a bad value raises on every read, not just the first."""
    monkeypatch.delenv("NSA_CP_P2P_TIMEOUT_MS", raising=False)
    assert envs.NSA_CP_P2P_TIMEOUT_MS == 60_000
    for raw, want in (("250", 250), ("250", 250), (" 7 ", 7), ("", 60_000), ("0", 0)):
        monkeypatch.setenv("NSA_CP_P2P_TIMEOUT_MS", raw)
        assert envs.NSA_CP_P2P_TIMEOUT_MS == want
    os.environ["NSA_CP_P2P_TIMEOUT_MS"] = "soon"
    for _ in range(2):
        with pytest.raises(ValueError, match="NSA_CP_P2P_TIMEOUT_MS: expected an integer, got 'soon'"):
            envs.NSA_CP_P2P_TIMEOUT_MS
    del os.environ["NSA_CP_P2P_TIMEOUT_MS"]
    assert envs.NSA_CP_P2P_TIMEOUT_MS == 60_000
    monkeypatch.setenv("NSA_CP_VALIDATE", "yes")
    assert envs.NSA_CP_VALIDATE is True
    monkeypatch.setenv("NSA_CP_VALIDATE", "off")
    assert envs.NSA_CP_VALIDATE is False


def test_no_nsa_cp_variable_outside_envs():
    """Every NSA_CP_* variable the package reads is declared in envs.py."""
    import pathlib
    import re

    root = pathlib.Path(nsa_cp.__file__).parent
    declared = set(envs.ENVIRONMENT_VARIABLES)
    for path in root.rglob("*.py"):
        if path.name == "envs.py":
            continue
        for name in re.findall(r"NSA_CP_[A-Z0-9_]+", path.read_text()):
            assert name in declared, f"{path.name} uses {name}, which envs.py does not declare"
        assert "os.environ" not in path.read_text() or path.name == "envs.py", f"{path.name} reads os.environ"
