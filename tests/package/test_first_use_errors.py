"""A new user's first mistakes get an answer where they are made: a ValueError naming the argument, what
was expected and what was given (never an AttributeError from inside a norm, a truthy string taken for
True, or a P2P hint that cannot work on CPU), and ``p2p_unavailable_reason()`` answers before
``init_process_group`` instead of raising."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

import nsa_cp
from dist_harness import case_failures, run_world


def test_shard_layout_of_a_bare_int_says_a_sequence_is_expected():
    for bad, shown in ((4, "int 4"), ("44", "str '44'"), (None, "NoneType None")):
        with pytest.raises(ValueError) as info:
            nsa_cp.ShardLayout(bad)
        message = str(info.value)
        assert "per_rank_actual_token" in message and "sequence of ints" in message, message
        assert "ShardLayout([4])" in message and shown in message, message
    assert nsa_cp.ShardLayout(iter([4, 2])).per_rank_actual_token == (4, 2)  # any iterable of ints still works


def _comm(**kw):
    return nsa_cp.NSACPLayerCommunicator(None, nsa_cp.RMSNorm(8), nsa_cp.RMSNorm(8), **kw)


def test_communicator_names_arguments_given_in_the_wrong_order():
    layout, x = nsa_cp.ShardLayout([4]), torch.randn(4, 8)
    comm = _comm()
    cases = [
        (lambda: comm.prepare_mlp(layout, x, None), "prepare_mlp", "hidden_states", "ShardLayout"),
        (lambda: comm.prepare_mlp(x, layout, None), "prepare_mlp", "residual", "ShardLayout"),
        (lambda: comm.prepare_attn(x, None, [4]), "prepare_attn", "layout", "got list"),
        (lambda: comm.postprocess_layer((x, x), x, layout), "postprocess_layer", "hidden_states", "got tuple"),
    ]
    for call, method, name, got in cases:
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert f"{method}(hidden_states, residual, layout): {name}: expected " in message, message
        assert got in message, message
    with pytest.raises(ValueError, match=r"expected the MLP's partials, a torch.Tensor \[rows, H\]"):
        comm.postprocess_layer((x, x), x, layout)


@pytest.mark.parametrize("name", ["compact", "fuse"])
@pytest.mark.parametrize("value, shown", [("no", "str 'no'"), (1, "int 1"), (None, "NoneType None")])
def test_communicator_flags_must_be_bools(name, value, shown):
    with pytest.raises(ValueError) as info:
        _comm(**{name: value})
    assert str(info.value) == f"{name}: expected True or False, got {shown}"
    _comm(**{name: False})


def test_p2p_unavailable_reason_before_init_process_group_is_a_reason(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    reason = nsa_cp.p2p_unavailable_reason()
    assert isinstance(reason, str) and "init_process_group" in reason, reason


@pytest.mark.parametrize("call", ["cp_overlapped_boundary", "cp_all_gather"])
def test_a_call_before_init_process_group_says_so_in_nsa_cps_words(monkeypatch, call):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    layout, x = nsa_cp.ShardLayout([4, 2]), torch.randn(4, 8)
    calls = {"cp_overlapped_boundary": lambda: nsa_cp.cp_overlapped_boundary(x, layout, lambda rows, chunk: rows),
             "cp_all_gather": lambda: nsa_cp.cp_all_gather(x, layout)}
    with pytest.raises(RuntimeError, match="need torch.distributed to be initialized"):
        calls[call]()


def _worker(rank, world, payload):
    results = {}
    layout, x = nsa_cp.ShardLayout([4] * world), torch.randn(4, 8)
    checks = {
        "compact-str": (lambda: nsa_cp.cp_all_gather(x, layout, compact="no"), ["compact: expected True or False",
                                                                                "got str 'no'"]),
        "compact-scatter": (lambda: nsa_cp.cp_reduce_scatter(torch.randn(4 * world, 8), layout, compact=1),
                            ["compact: expected True or False", "got int 1"]),
        "p2p-on-cpu": (lambda: nsa_cp.cp_all_gather(x, layout, backend="p2p"),
                       ["backend: 'p2p' cannot serve this call (x)", "cannot serve cpu tensors", "CUDA"]),
    }
    for case, (call, words) in checks.items():
        try:
            try:
                call()
                raise AssertionError(f"{case}: no error")
            except ValueError as err:
                missing = [w for w in words if w not in str(err)]
                assert not missing and "init_p2p" not in str(err), f"{case}: {err} (missing {missing})"
            results[case] = None
        except Exception:  # noqa: BLE001
            results[case] = traceback.format_exc()
    return results


_RESULTS = {}


@pytest.mark.parametrize("case", ["compact-str", "compact-scatter", "p2p-on-cpu"])
def test_collectives_refuse_what_cannot_work(case):
    if "world" not in _RESULTS:
        _RESULTS["world"] = run_world(1, "gloo", _worker, None, timeout_s=240)
    errors = case_failures(_RESULTS["world"], case)
    assert not errors, "\n".join(errors)


def test_tests_from_the_checkouts_parent_folder_say_why(tmp_path):
    """A checkout in a folder named nsa_cp, and pytest started in its parent: the folder comes first on sys.path
    and would be imported as an empty namespace package (every test an AttributeError); tests/conftest.py
    stops the run once, saying why and what to do."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "nsa_cp").symlink_to(Path(__file__).resolve().parents[2], target_is_directory=True)
    proc = subprocess.run([sys.executable, "-m", "pytest", "nsa_cp/tests/package/test_public_surface.py", "-q",
                           "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-3000:]
    assert "the checkout's parent" in out and "cd nsa_cp" in out, out[-3000:]
