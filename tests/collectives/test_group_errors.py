"""A wrong ``group`` is a ValueError naming ``group`` (what was expected, what came) on every public call and
on the transports' entry points: a name or a rank instead of a group, and a rank outside the group it
passes (``dist.new_group`` hands such a rank ``GroupMember.NON_GROUP_MEMBER``). gloo, world 2: rank 1 is
outside ``new_group([0])``."""

from __future__ import annotations

import traceback

import pytest
import torch

from dist_harness import case_failures, run_world

H = 16


def _calls(layout, x, rank):
    import nsa_cp

    w = torch.ones(H)
    n = layout.count(rank)
    return {
        "cp_all_gather": lambda g: nsa_cp.cp_all_gather(x, layout, g),
        "cp_all_gather_compact": lambda g: nsa_cp.cp_all_gather(x, layout, g, compact=True),
        "cp_reduce_scatter": lambda g: nsa_cp.cp_reduce_scatter(torch.randn(layout.padded_len, H), layout, g),
        "cp_reduce_scatter_buffer": lambda g: nsa_cp.cp_reduce_scatter_buffer(x, layout, g),
        "fused_add_rmsnorm_all_gather": lambda g: nsa_cp.fused_add_rmsnorm_all_gather(
            x, torch.randn(n, H), w, 1e-6, layout, g),
        "reduce_scatter_fused_add_rmsnorm": lambda g: nsa_cp.reduce_scatter_fused_add_rmsnorm(
            torch.randn(layout.padded_len, H), torch.randn(n, H), w, 1e-6, layout, g),
        "init_p2p": lambda g: nsa_cp.init_p2p(g, 8, H, torch.float32),
        "p2p_unavailable_reason": lambda g: nsa_cp.p2p_unavailable_reason(g),
        "init_nccl": lambda g: nsa_cp.init_nccl(g),
        "nccl_unavailable_reason": lambda g: nsa_cp.nccl_unavailable_reason(g),
    }


def _worker(rank, world, payload):
    import torch.distributed as dist

    import nsa_cp

    only_rank0 = dist.new_group([0])  # collective: every rank calls it; rank 1 gets a non-member marker
    layout = nsa_cp.ShardLayout([5, 3])
    x = torch.randn(layout.count(rank), H)
    results = {}
    for name, call in _calls(layout, x, rank).items():
        for what, group in (("name", "attn_cp"), ("rank", 0), ("non-member", only_rank0 if rank == 1 else "skip")):
            key = f"{name}-{what}"
            if isinstance(group, str) and group == "skip":  # rank 0 is a member: only rank 1 checks this
                results[key] = None
                continue
            try:
                call(group)
                results[key] = f"rank {rank}: no error for group={group!r}"
            except ValueError as err:
                text = str(err)
                ok = text.startswith("group:") and "expected" in text and ("got" in text)
                results[key] = None if ok else f"rank {rank}: ValueError not naming group: {text}"
            except Exception:  # noqa: BLE001
                results[key] = f"rank {rank}: not a ValueError:\n{traceback.format_exc()}"
    return results


KEYS = [f"{name}-{what}" for name in ("cp_all_gather", "cp_all_gather_compact", "cp_reduce_scatter",
                                      "cp_reduce_scatter_buffer", "fused_add_rmsnorm_all_gather",
                                      "reduce_scatter_fused_add_rmsnorm", "init_p2p", "p2p_unavailable_reason",
                                      "init_nccl", "nccl_unavailable_reason")
        for what in ("name", "rank", "non-member")]
_WORLD = {}


@pytest.mark.parametrize("key", KEYS)
def test_wrong_group_is_a_value_error_naming_group(key):
    if "w" not in _WORLD:
        _WORLD["w"] = run_world(2, "gloo", _worker, None, timeout_s=240)
    errors = case_failures(_WORLD["w"], key)
    assert not errors, "\n".join(errors)
