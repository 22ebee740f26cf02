"""nsa_cp.integrations.sglang on CPU: metadata -> layout, the CpMoves functions on gloo, install().

SGLang is not needed: metadata and forward batches are duck-typed objects with SGLang 0.5.23's field
names (``attn_cp_metadata``, ``per_rank_actual_token``, ``per_rank_logical_token``, ``max_rank_len``), and
install() is tested against stand-in ``sglang.srt.layers.layer_boundary`` modules. Two tests use SGLang's
own code where it imports (tests/support/sglang_env.py); tests/integrations/sglang/test_sglang_real.py runs the moves against it.
"""

from __future__ import annotations

import subprocess
import sys
import types
from types import SimpleNamespace as NS

import pytest
import torch

import nsa_cp
from dist_harness import case_failures, run_world
from nsa_cp.integrations import sglang as adapter_mod
from nsa_cp.integrations.sglang import layout_from_cp_metadata


def _padded_md(logical, align):
    """What SGLang's cp/padding.pad_logical_token_to_physical leaves behind."""
    physical = -(-max(logical) // align) * align
    return NS(per_rank_logical_token=list(logical), per_rank_actual_token=[physical] * len(logical),
              max_rank_len=[physical] * len(logical))


# ----------------------------------------------------------------------------- layout_from_cp_metadata
@pytest.mark.parametrize("logical,align", [([7, 6], 4), ([9, 0], 4), ([5, 5], 4), ([6, 5, 4, 4], 8), ([1, 2, 3], 6)])
def test_layout_from_padded_metadata(logical, align):
    md = _padded_md(logical, align)
    layout = layout_from_cp_metadata(md)
    assert layout.per_rank_actual_token == tuple(logical)
    assert layout.max_rank_len == md.per_rank_actual_token[0]   # SGLang's gathered buffer, row for row
    assert layout.padded_len == md.per_rank_actual_token[0] * len(logical)


@pytest.mark.parametrize("logical", [None, []])
def test_layout_from_unpadded_metadata(logical):
    md = NS(per_rank_actual_token=[7, 5, 0], per_rank_logical_token=logical, max_rank_len=[7, 7, 7])
    layout = layout_from_cp_metadata(md)
    assert layout.per_rank_actual_token == (7, 5, 0)
    assert layout.max_rank_len == 7 and layout.align == 1
    assert layout_from_cp_metadata(md, align=4).max_rank_len == 8


def test_layout_from_metadata_without_logical_field_and_tensors():
    md = NS(per_rank_actual_token=torch.tensor([3, 4]))
    assert layout_from_cp_metadata(md).per_rank_actual_token == (3, 4)


@pytest.mark.parametrize(
    "md,match",
    [
        (NS(per_rank_actual_token=None, per_rank_logical_token=None), r"md.per_rank_actual_token: expected a list"),
        (NS(), r"md.per_rank_actual_token: expected a list"),
        (NS(per_rank_actual_token=[8, 8], per_rank_logical_token=[7]), r"md.per_rank_logical_token: expected 2 counts"),
        (NS(per_rank_actual_token=[8, 8], per_rank_logical_token=[9, 1]), r"md.per_rank_logical_token: expected counts in \[0, 8\]"),
        (NS(per_rank_actual_token=[8, 8], per_rank_logical_token=[-1, 1]), r"md.per_rank_logical_token: expected counts in \[0, 8\]"),
        (NS(per_rank_actual_token=["a", 8]), r"md.per_rank_actual_token: expected a list of ints"),
    ],
)
def test_layout_from_bad_metadata(md, match):
    with pytest.raises(ValueError, match=match):
        layout_from_cp_metadata(md)


def test_no_sglang_import_at_load():
    code = "import sys, nsa_cp.integrations.sglang; assert 'sglang' not in sys.modules, sorted(m for m in sys.modules if m.startswith('sglang'))"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mask_padding_topk_ids_for_batch():
    fb = NS(attn_cp_metadata=_padded_md([3, 1], 4))
    ids = torch.arange(16, dtype=torch.int64).view(8, 2)
    want = ids.clone()
    want[3:4] = -1
    want[5:8] = -1
    adapter_mod.mask_padding_topk_ids_for_batch(ids, fb)
    assert torch.equal(ids, want)


# ----------------------------------------------------------------------------- the moves on gloo
H = 24
CASES = {
    # id: (per-rank logical counts, align) ; align None: unpadded metadata (uneven local tensors)
    "padded-uneven": ([7, 3], 4),
    "padded-zero-token-rank": ([5, 0], 4),
    "padded-even": ([8, 8], 4),
    "padded-already-even-logical": ([6, 6], 4),
    "unpadded-uneven": ([7, 3], None),
    "unpadded-even": ([4, 4], None),
    "empty": ([0, 0], None),
}


def _batch(counts, align):
    if align is None:
        md = NS(per_rank_actual_token=list(counts), per_rank_logical_token=None, max_rank_len=[max(counts)] * len(counts))
    else:
        md = _padded_md(counts, align)
    return NS(attn_cp_metadata=md)


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def _sglang_read_step(hidden_states, residual, forward_batch, norm, *, update=None, cache=None, **call):
    """Stand-in for SGLang's read step (residual add + norm), recording how it was called."""
    call_log.append(dict(update=update, cache=cache, **call))
    summed = hidden_states + residual
    return norm(summed), summed


call_log = []


def _moves_worker(rank, world, payload):
    results = {}
    torch.set_num_threads(1)
    adapter_mod.configure(None)   # default group; SGLang is not set up here
    torch.set_grad_enabled(False)  # SGLang serves without autograd
    for case_id, (counts, align) in payload.items():
        try:
            fb = _batch(counts, align)
            md = fb.attn_cp_metadata
            rows = md.per_rank_actual_token[rank]
            n = counts[rank]
            m = max(md.per_rank_actual_token) if md.per_rank_actual_token else 0
            norm = nsa_cp.RMSNorm(H)
            # every rank's local tensors, known to all: SGLang's [physical, H], real rows first
            hs = [_rand(100 + q, md.per_rank_actual_token[q], H) for q in range(world)]
            res = [_rand(200 + q, md.per_rank_actual_token[q], H) for q in range(world)]
            call_log.clear()
            gathered, residual = adapter_mod.gather(hs[rank], res[rank], fb, norm, gather=_sglang_read_step,
                                                    update="UPDATE", cache="CACHE", extra=1)
            assert call_log == [dict(update="UPDATE", cache="CACHE", extra=1)], call_log
            assert torch.equal(residual, hs[rank] + res[rank])
            assert list(gathered.shape) == [m * world, H], gathered.shape
            for q in range(world):
                want = norm(hs[q] + res[q])[: counts[q]]
                slot = gathered[q * m : (q + 1) * m]
                assert torch.equal(slot[: counts[q]], want), f"rank {q}'s rows"
                assert torch.equal(slot[counts[q]:], torch.zeros_like(slot[counts[q]:])), f"rank {q}'s padding"
            # take_back: this rank's physical block of a complete output, a view
            full = _rand(300, m * world, H)
            back, r2 = adapter_mod.take_back(full, residual, fb)
            assert r2 is residual and torch.equal(back, full[rank * m : rank * m + rows])
            # reduce_scatter: the sum of every rank's partials over this rank's real rows, zeros after
            partials = [_rand(400 + q, m * world, H) for q in range(world)]
            for q in range(world):  # padding rows carry garbage: it must not reach a real row
                for p in range(world):
                    partials[q][p * m + counts[p] : (p + 1) * m] = float("nan")
            out, r3 = adapter_mod.reduce_scatter(partials[rank].clone(), residual, fb)
            assert r3 is residual and list(out.shape) == [rows, H], out.shape
            want = sum(p.double() for p in partials)[rank * m : rank * m + n]
            assert torch.allclose(out[:n].double(), want, rtol=1e-6, atol=1e-6)
            assert torch.equal(out[n:], torch.zeros_like(out[n:]))
            group = adapter_mod.reduce_scatter_group()
            assert list(group.ranks) == list(range(world)), group
            results[case_id] = None
        except Exception as e:  # noqa: BLE001
            import traceback

            results[case_id] = traceback.format_exc()
    # a wrong local row count is a ValueError naming the tensor, before any collective
    try:
        fb = _batch([7, 3], 4)
        try:
            adapter_mod.gather(_rand(1, 5, H), _rand(2, 5, H), fb, nsa_cp.RMSNorm(H), gather=_sglang_read_step)
            results["bad-rows"] = "no ValueError"
        except ValueError as e:
            results["bad-rows"] = None if "hidden_states: expected 8 local rows" in str(e) else str(e)
        try:
            adapter_mod.reduce_scatter(_rand(1, 9, H), None, fb)
            results["bad-global"] = "no ValueError"
        except ValueError as e:
            results["bad-global"] = None if "hidden_states: expected [16, ...]" in str(e) else str(e)
    except Exception:  # noqa: BLE001
        import traceback

        results["bad-rows"] = results["bad-global"] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def moves_world():
    return run_world(2, "gloo", _moves_worker, CASES, timeout_s=300)


@pytest.mark.parametrize("case_id", list(CASES) + ["bad-rows", "bad-global"])
def test_cp_moves_on_gloo(moves_world, case_id):
    errors = case_failures(moves_world, case_id)
    assert not errors, "\n".join(errors)


# ----------------------------------------------------------------------------- install()
@pytest.fixture
def fake_sglang(monkeypatch):
    """Stand-ins for the SGLang modules install() touches, with the same names and binding by name."""
    names = ["sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.layer_boundary",
             "sglang.srt.layers.layer_boundary.contracts", *adapter_mod.BOUNDARY_MODULES, "sglang.srt.model_executor",
             "sglang.srt.model_executor.model_runner"]
    mods = {name: types.ModuleType(name) for name in names}

    class CpMoves:  # msgspec.Struct in SGLang; the fields are what matter
        def __init__(self, gather, take_back, reduce_scatter=None, reduce_scatter_group=None):
            self.gather, self.take_back = gather, take_back
            self.reduce_scatter, self.reduce_scatter_group = reduce_scatter, reduce_scatter_group

    mods["sglang.srt.layers.layer_boundary.contracts"].CpMoves = CpMoves
    state = NS(kind="attn_cp", calls=[])
    coordinator = NS(ranks=[0, 1])

    def theirs(name):
        def move(*args, **kwargs):
            state.calls.append(name)
            return "sglang-" + name
        return move

    def _cp_moves():
        if state.kind == "attn_cp":
            return CpMoves(theirs("gather"), theirs("take_back"), theirs("reduce_scatter"), lambda: coordinator)
        return CpMoves(theirs("moe_gather"), theirs("moe_take_back"))

    def _bind_stage(declaration, *args, **kwargs):
        return declaration

    class ModelRunner:
        def initialize(self):
            return "initialized"

    for name in adapter_mod.BOUNDARY_MODULES:
        mods[name]._cp_moves = _cp_moves
    for name in adapter_mod.BOUNDARY_MODULES[1:]:
        mods[name]._bind_stage = _bind_stage
    mods["sglang.srt.model_executor.model_runner"].ModelRunner = ModelRunner
    for name in names[1:]:  # a package's attribute is its submodule, as after an import
        parent, child = name.rsplit(".", 1)
        setattr(mods[parent], child, mods[name])
    for name, module in mods.items():
        monkeypatch.setitem(sys.modules, name, module)
    return NS(mods=mods, original=_cp_moves, state=state, coordinator=coordinator, CpMoves=CpMoves)


def test_install_on_code_that_meets_no_contract_patches_nothing(fake_sglang):
    """The stand-ins are not SGLang's code (no readable _cp_moves source, no ops/prepare modules): install()
    refuses before it patches anything, naming what differs."""
    from nsa_cp.integrations.contracts import ContractMismatch

    with pytest.raises(ContractMismatch, match="_cp_moves"):
        adapter_mod.install(group=None)
    assert all(fake_sglang.mods[name]._cp_moves is fake_sglang.original for name in adapter_mod.BOUNDARY_MODULES)


def test_install_patches_every_binding_and_uninstalls(fake_sglang, monkeypatch):
    from nsa_cp.integrations.contracts import Verdict
    from nsa_cp.integrations.sglang import contract

    # the patching mechanics on stand-ins: their contract is taken as met (the real one is checked against
    # SGLang's own code in test_sglang_real.py)
    monkeypatch.setattr(contract, "verify", lambda: Verdict(contract.KNOWN[0], {}))
    handle = adapter_mod.install(group=None)
    try:
        patched = [fake_sglang.mods[name]._cp_moves for name in adapter_mod.BOUNDARY_MODULES]
        assert all(p is patched[0] and p is not fake_sglang.original for p in patched)
        moves = patched[0]()
        assert isinstance(moves, fake_sglang.CpMoves)
        assert moves.reduce_scatter_group() is fake_sglang.coordinator       # SGLang's GroupCoordinator kept
        assert moves.gather.__name__ == "gather_" and moves.reduce_scatter.__name__ == "reduce_scatter_"
        # a batch under SGLang's breakable CUDA graph keeps SGLang's moves
        graph_batch = NS(attn_cp_metadata=NS(graph_num_tokens=64, per_rank_actual_token=[8, 8]))
        assert moves.take_back(None, None, graph_batch) == "sglang-take_back"
        assert moves.reduce_scatter(None, None, graph_batch) == "sglang-reduce_scatter"
        assert moves.gather(None, None, graph_batch, None, gather=None) == "sglang-gather"
        # the GQA MoE-CP kind is not replaced
        fake_sglang.state.kind = "moe_cp"
        other = patched[0]()
        assert other.reduce_scatter is None and other.take_back() == "sglang-moe_take_back"
        assert adapter_mod.install() is handle, "a second install patched again"  # the plugin's too: one path
        assert adapter_mod.status()["active"], adapter_mod.status()["bound"]
    finally:
        handle.uninstall()
    assert all(fake_sglang.mods[name]._cp_moves is fake_sglang.original for name in adapter_mod.BOUNDARY_MODULES)
    assert not adapter_mod.status()["active"] and not adapter_mod.status()["plugin_registered"]


def test_install_without_sglang_raises_import_error(monkeypatch):
    for name in list(sys.modules):
        if name == "sglang" or name.startswith("sglang."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError, installed or not
    with pytest.raises(ImportError):
        adapter_mod.install()


# ----------------------------------------------------------------------------- SGLang's own metadata
def test_layout_from_sglang_built_metadata():
    """Metadata from SGLang 0.5.23's own zigzag strategy and padding (tests/support/sglang_env.py)."""
    import sglang_env

    sglang_env.require_sglang()
    for cp, seq_lens in ((2, [37, 64, 21]), (4, [9, 10]), (2, [3])):
        md, logical = sglang_env.build_metadata(seq_lens, cp)
        layout = layout_from_cp_metadata(md)
        assert logical == nsa_cp.in_seq_split(seq_lens, cp)
        assert list(layout.per_rank_actual_token) == nsa_cp.in_seq_split(seq_lens, cp)
        assert layout.max_rank_len == md.per_rank_actual_token[0] == md.max_rank_len[0]
        assert layout.max_rank_len % (2 * cp) == 0


def test_install_on_sglang_modules():
    """install() finds every module of SGLang 0.5.23 that binds ``_cp_moves`` by name, where SGLang imports."""
    import importlib

    import sglang_env

    sglang_env.require_sglang()
    modules = [importlib.import_module(name) for name in adapter_mod.BOUNDARY_MODULES]
    original = modules[0]._cp_moves
    assert all(m._cp_moves is original for m in modules)
    handle = adapter_mod.install()
    try:
        assert all(m._cp_moves is not original and m._cp_moves is modules[0]._cp_moves for m in modules)
    finally:
        handle.uninstall()
    assert all(m._cp_moves is original for m in modules)
