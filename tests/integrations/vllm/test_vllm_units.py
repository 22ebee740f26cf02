"""The vLLM binding's pieces that need no vLLM: the per-step layout kept from PCPManager (and tied to the
step's padding mask), the worker hook's order and its failure isolation. vLLM's own code runs them in
test_vllm_moe.py and test_vllm_plugin.py."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from nsa_cp.integrations import state
from nsa_cp.integrations.vllm import plugin, step, worker


def test_step_layout_of_a_graph_bucket_puts_rank_r_at_r_times_m():
    current = step.StepLayout.from_counts([23, 27], 48, None)
    assert current.layout.max_rank_len == current.rows == 48
    assert current.layout.padded_len == 96 and current.layout.total_len == 50
    assert step.StepLayout.from_counts([23, 27], 27, None).layout.padded_len == 54


def test_counts_are_kept_where_vllm_computes_them_and_tied_to_the_batch_mask():
    mask = torch.zeros(54, dtype=torch.bool)
    manager = types.SimpleNamespace()

    def build(manager, nst, ncomp, isp, qsl, padded_num_tokens=None):
        return "segments", [23, 27]

    def partition(manager, batch, desc):
        step.build_batch_layout(build, manager, None, None, None, None, padded_num_tokens=desc)
        return types.SimpleNamespace(is_padding=mask)

    local = step.partition_batch(partition, manager, "batch", None)
    current = step.current()
    assert current.is_padding is local.is_padding is mask and current.rows == 27
    assert list(current.layout.per_rank_actual_token) == [23, 27]
    assert step.for_forward(types.SimpleNamespace(is_padding=mask)) is current
    # another forward (dummy, profile, micro-batch) carries another mask: not this step's
    assert step.for_forward(types.SimpleNamespace(is_padding=mask.clone())) is None
    assert step.for_forward(None) is None
    step.partition_batch(partition, manager, "batch", 40)  # under a CUDA-graph bucket of 40 rows
    assert step.current().rows == 40 and step._BUILT == {}
    assert vars(manager) == {}, "nsa_cp left state on vLLM's manager"

    def failing(manager, batch, desc):
        step.build_batch_layout(build, manager, None, None, None, None)
        raise RuntimeError("vLLM refused the batch")

    with pytest.raises(RuntimeError):
        step.partition_batch(failing, manager, "batch", None)
    assert step.current() is None, "a batch vLLM did not partition leaves no layout behind"
    assert step._BUILT == {}, "a failed partition left its counts for the next batch"


def test_worker_hook_sets_up_the_transport_after_vllm_loads_the_model(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(worker, "setup_transport", lambda w: calls.append(("setup", w)))
    hook = {t.role: t.around for t in plugin.TABLE}["load_model"]
    assert hook(lambda w, **kw: calls.append(("load", w, kw)) or "loaded", "w", load_dummy_weights=True) == "loaded"
    assert calls == [("load", "w", {"load_dummy_weights": True}), ("setup", "w")]

    def broken(w):
        raise RuntimeError("no peer memory")

    monkeypatch.setattr(worker, "setup_transport", broken)
    with caplog.at_level(logging.ERROR, logger="nsa_cp"):
        assert hook(lambda w: "loaded", "w") == "loaded"  # never raised into vLLM
    assert "transport setup failed" in caplog.text


def test_transport_decision_without_vllms_sizes_says_which_is_missing():
    decision = state.create_sized(None, 7168, torch.bfloat16, lambda *a: pytest.fail("created"), "vLLM")
    assert not decision["on"] and "vLLM's sizes not found (rows per rank None" in decision["reason"]

    def raises(rows, hidden, dtype):
        raise RuntimeError("cudaMalloc failed")

    decision = state.create_sized(4608, 7168, torch.bfloat16, raises, "vLLM")
    assert decision["reason"] == "creating it failed (RuntimeError: cudaMalloc failed)"


def _pending_compact(runner, context, saved):
    from nsa_cp.integrations.vllm import moe

    moe.PENDING[id(runner)] = moe._Pending(None, True, context, saved)


@pytest.mark.parametrize("raises", [False, True])
def test_forward_puts_the_compact_mask_back_when_it_ends(raises):
    """A compact dispatch swaps the forward context's mask; a MoE that raises before its combine must not
    leave the swapped mask, or nsa_cp's pending step, behind."""
    from nsa_cp.integrations.vllm import moe

    runner = types.SimpleNamespace()
    saved, swapped = torch.ones(6, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)
    context = types.SimpleNamespace(is_padding=saved)

    def impl(runner, hidden_states, router_logits, shared_experts_input, input_ids=None):
        context.is_padding = swapped
        _pending_compact(runner, context, saved)
        if raises:
            raise RuntimeError("expert kernel failed")
        return "out"

    if raises:
        with pytest.raises(RuntimeError, match="expert kernel failed"):
            moe.forward(impl, runner, "h", "l", None)
    else:
        assert moe.forward(impl, runner, "h", "l", None) == "out"
    assert context.is_padding is saved and id(runner) not in moe.PENDING
    assert vars(runner) == {}, "nsa_cp left state on vLLM's runner"


def test_the_target_table_wraps_contract_roles_at_one_path_each():
    from nsa_cp.integrations.vllm import contract

    roles = [t.role for t in plugin.TABLE]
    assert len(set(roles)) == len(roles) == len(plugin.TARGETS)
    for known in contract.KNOWN:
        assert set(roles) <= set(known.specs), f"{known.name} lacks a wrapped role"
        assert {known.specs[r].paths[0] for r in roles} == set(plugin.TARGETS)
