"""What the engine test environments share (``sglang_env``, ``vllm_env``): whether an engine's modules import
here, and the skip (or, where CI requires the engine, the failure) when they do not."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import Iterable, Optional


def import_error(package: str, modules: Iterable[str], tested: Iterable[str]) -> Optional[str]:
    """None when ``package`` and ``modules`` import here at one of the versions ``tested``, else the reason."""
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001  any failure means: not testable in this environment
        return f"{package}'s modules do not import here ({type(e).__name__}: {e})"
    version = getattr(importlib.import_module(package), "__version__", "?")
    tested = (tested,) if isinstance(tested, str) else tuple(tested)
    if not any(str(version).startswith(t) for t in tested):
        return f"{package} {version} is installed; these tests are written against {' or '.join(tested)}"
    return None


def require(reason: Optional[str], required_variable: str, install: str) -> None:
    """Skip the calling test for ``reason`` (None: nothing), or fail it where ``required_variable`` is 1."""
    if reason is None:
        return
    import pytest  # here only: the benchmarks use the engine modules without pytest

    if os.environ.get(required_variable, "") == "1":
        pytest.fail(f"{required_variable}=1 but {reason}")
    pytest.skip(f"{reason}; install {install} to run this check")


def nsa_cp_records() -> list:
    """A list that collects, from now on in this process, every record the "nsa_cp" logger passes on (the
    plugins' warnings and lines of what they declined)."""
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("nsa_cp").addHandler(handler)
    return records
