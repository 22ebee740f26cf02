"""A transport that owns its lifecycle joins as one module and one table row, and every creator makes, uses
and closes it: the communicator (``p2p_max_tokens_per_rank``), SGLang's scheduler setup and vLLM's worker
setup (nsa_cp/integrations/), all through the one creation policy (nsa_cp/transport/policy.py), which names
no transport.

The stand-in is tests/support/lifecycle_transport.py; the only other change is its row, put first in
``nsa_cp.transports.TRANSPORTS``. On gloo at 2 ranks, in each case: the creator made it once for its sizes
(``EVENTS``), the decision names it, a gather and a reduce-scatter went through it (the loopback's
``CALLS``) with nsa_cp's own results, a batch larger than it was made for takes the torch.distributed path,
and ``close_transports`` closes it (the next call is torch.distributed's again)."""

from __future__ import annotations

import traceback
from types import SimpleNamespace as NS
from unittest import mock

from dist_harness import case_failures, run_world

H = 64
ROW = ("standin", "lifecycle_transport", "PROVIDER")


def _with_row():
    """The stand-in's row, first in the table (a fresh spawned process: nothing cached before it)."""
    from nsa_cp import transports

    transports.TRANSPORTS = (transports.TransportRow(*ROW), *transports.TRANSPORTS)


def _use_and_close(rank, group, made_for, moves):
    """A gather and a reduce-scatter reach the stand-in (``moves(x, layout)`` -> (gathered, summed), the
    creator's own moves) with nsa_cp's torch.distributed results; a larger batch does not; closing it
    restores the torch.distributed path."""
    import torch

    import lifecycle_transport
    import loopback_transport
    import nsa_cp
    from nsa_cp.transport import close_transports

    layout = nsa_cp.ShardLayout([made_for, made_for - 3])
    g = torch.Generator().manual_seed(3 + rank)
    x = torch.randn(layout.count(rank), H, generator=g).bfloat16()
    before = len(loopback_transport.CALLS)
    gathered, summed = moves(x, layout)
    ops = [op for op, _ in loopback_transport.CALLS[before:]]
    assert "cp_all_gather" in ops or "fused_add_rmsnorm_all_gather" in ops, ops
    assert "cp_reduce_scatter" in ops, ops
    assert torch.equal(gathered, nsa_cp.cp_all_gather(x, layout, group, backend="nccl")), "gather differs"
    want = nsa_cp.cp_reduce_scatter(gathered, layout, group, backend="nccl")
    assert torch.allclose(summed.double(), want.double(), rtol=2 ** -6, atol=2 ** -6), "reduce-scatter differs"
    big = nsa_cp.ShardLayout([made_for + 1, 1])
    before = len(loopback_transport.CALLS)
    nsa_cp.cp_all_gather(torch.randn(big.count(rank), H).bfloat16(), big, group)
    assert len(loopback_transport.CALLS) == before, "a batch larger than the stand-in was made for reached it"
    close_transports(group)
    assert lifecycle_transport.EVENTS[-1] == ("close",), lifecycle_transport.EVENTS
    nsa_cp.cp_all_gather(x, layout, group)
    assert len(loopback_transport.CALLS) == before, "the closed stand-in still ran"


def _communicator_case(rank, world):
    import torch

    import lifecycle_transport
    import nsa_cp

    _with_row()
    norm = lambda: torch.nn.RMSNorm(H, eps=1e-6, dtype=torch.bfloat16)  # noqa: E731
    comm = nsa_cp.NSACPLayerCommunicator(None, norm(), norm(), p2p_max_tokens_per_rank=8, hidden_size=H,
                                         dtype=torch.bfloat16)
    nsa_cp.NSACPLayerCommunicator(None, norm(), norm(), p2p_max_tokens_per_rank=6, hidden_size=H, dtype=torch.bfloat16)
    assert lifecycle_transport.EVENTS == [("create", 8)], lifecycle_transport.EVENTS  # one that fits is kept

    def moves(x, layout):
        comm.prepare_mlp(x, None, layout)  # the fused add + RMSNorm gather
        full = nsa_cp.cp_all_gather(x, layout, None)
        buf = comm.mlp_output_buffer(layout, full)
        buf.copy_(full)
        summed, _ = comm.postprocess_layer(buf, None, layout)
        return full, summed

    _use_and_close(rank, None, 8, moves)


def _engine_case(rank, setup):
    """An engine plugin's worker setup (``setup()`` -> (decision, rows per rank it sized for, the group, the
    plugin's status())) made the stand-in once for its sizes and reports it; the plugins' own row moves
    (nsa_cp/integrations/moves.py: a padded gather and the reduce-scatter of it) go through it; it closes."""
    import lifecycle_transport
    from nsa_cp.integrations import moves

    _with_row()
    decision, rows, group, status = setup()
    assert decision["on"] and decision["transport"] == "standin", decision
    assert lifecycle_transport.EVENTS == [("create", rows)], lifecycle_transport.EVENTS
    assert status["p2p"] == decision, status["p2p"]

    def run(x, layout):
        gathered = moves.gather_rows(x, layout, rank, group, compact=False)
        return gathered, moves.reduce_scatter_rows(gathered.clone(), layout, rank, layout.count(rank), group)

    _use_and_close(rank, group, rows, run)


def _sglang_setup(rank, world):
    import torch

    import sglang_env

    coordinator = sglang_env.setup_parallel(rank, world)
    import nsa_cp.integrations.sglang as nsa_sglang
    from nsa_cp.integrations.sglang import runtime, scheduler

    nsa_sglang.configure(coordinator.device_group)
    runner = NS(server_args=NS(chunked_prefill_size=32, max_prefill_tokens=32, enable_symm_mem=False),
                model_config=NS(hidden_size=H, dtype=torch.bfloat16))
    with mock.patch.object(runtime, "cp_gathers_over_attn_cp", return_value=True):
        decision = scheduler.setup_transport(runner)
    rows = scheduler.max_tokens_per_rank(runner.server_args, world, runtime.cp_align(world))
    return decision, rows, coordinator.device_group, nsa_sglang.status()


def _vllm_setup(rank, world):
    import torch

    import vllm_env
    from vllm.config import SchedulerConfig

    import nsa_cp.integrations.vllm as nsa_vllm
    from nsa_cp.integrations.vllm import worker

    _, coordinator = vllm_env.setup_parallel(rank, world)
    limits = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2, max_model_len=32, is_encoder_decoder=False)
    fake = NS(vllm_config=NS(scheduler_config=limits, model_config=NS(get_hidden_size=lambda: H, dtype=torch.bfloat16)),
              device=torch.device("cpu"))
    decision = worker.setup_transport(fake)
    return decision, worker.max_tokens_per_rank(limits, world), coordinator.device_group, nsa_vllm.status()


def _worker(rank, world, case):
    try:
        if case == "communicator":
            _communicator_case(rank, world)
        else:
            _engine_case(rank, lambda: (_sglang_setup if case == "sglang" else _vllm_setup)(rank, world))
        return {case: None}
    except Exception:  # noqa: BLE001
        return {case: traceback.format_exc()}


def _run(case):
    failures = case_failures(run_world(2, "gloo", _worker, case, timeout_s=300), case)
    assert not failures, "\n".join(failures)


def test_the_communicator_creates_uses_and_closes_a_stand_in_transport():
    _run("communicator")


def test_sglangs_setup_creates_uses_and_closes_a_stand_in_transport():
    import sglang_env

    sglang_env.require_sglang()
    _run("sglang")


def test_vllms_setup_creates_uses_and_closes_a_stand_in_transport():
    import vllm_env

    vllm_env.require_vllm()
    _run("vllm")
