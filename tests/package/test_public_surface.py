"""The top-level surface: every name of ``nsa_cp.__all__`` resolves; the lifecycle helpers that left the
top level live in ``nsa_cp.transport`` and are still reachable from ``nsa_cp`` with a DeprecationWarning."""

import warnings

import pytest

import nsa_cp
import nsa_cp.support
import nsa_cp.transport

MOVED = {"get_p2p": nsa_cp.transport, "destroy_p2p": nsa_cp.transport, "get_nccl": nsa_cp.transport,
         "destroy_nccl": nsa_cp.transport, "workspace_bytes": nsa_cp.transport, "Support": nsa_cp.support}


def test_every_public_name_resolves_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in nsa_cp.__all__:
            assert getattr(nsa_cp, name) is not None, name
    assert not set(MOVED) & set(nsa_cp.__all__)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_moved_names_warn_and_are_the_same_object(name):
    with pytest.warns(DeprecationWarning, match=rf"nsa_cp\.{name} is deprecated: use {MOVED[name].__name__}\.{name}"):
        old = getattr(nsa_cp, name)
    assert old is getattr(MOVED[name], name)


def test_transport_holds_the_lifecycle():
    for name in ("init_p2p", "get_p2p", "destroy_p2p", "p2p_unavailable_reason", "init_nccl", "get_nccl",
                 "destroy_nccl", "nccl_unavailable_reason", "workspace_bytes"):
        assert callable(getattr(nsa_cp.transport, name)), name
    assert nsa_cp.init_p2p is nsa_cp.transport.init_p2p and nsa_cp.init_nccl is nsa_cp.transport.init_nccl


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        nsa_cp.not_a_name  # noqa: B018
