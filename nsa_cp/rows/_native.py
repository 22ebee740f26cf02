"""Loader for the optional native module ``nsa_cp._C`` (CUDA kernels, built by setup.py with nvcc).

``_C`` is torch-free: it takes device pointers, sizes and a CUDA stream as Python ints, and links the
CUDA runtime statically, so it imports on any machine, GPU or not. Whether its kernels can run is a
separate question, answered by :func:`available` (a CUDA device must be visible).

Nothing here raises: callers ask :func:`load` (the module or None), :func:`support` (a ``Support``
verdict: truthy, or falsy with why not) or :func:`device_support` (per GPU), and take another path when
it is missing; :func:`unavailable_reason` is the verdict's sentence for messages (None when available).
The first :func:`available` call initializes the CUDA driver in this process (``cudaGetDeviceCount``),
so do not call it in a parent process that will fork CUDA workers.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from types import ModuleType
from typing import Optional

import torch

from ..support import Support

__all__ = [
    "load", "available", "support", "unavailable_reason", "device_support", "current_stream", "stream_getter",
    "launch_device",
]

logger = logging.getLogger("nsa_cp")

_lock = threading.Lock()
_loaded = False
_module: Optional[ModuleType] = None
_import_reason = ""
_checked = False
_available = False
_reason = ""


def load() -> Optional[ModuleType]:
    """The ``nsa_cp._C`` module, or None when it was not built or does not import (never raises)."""
    global _loaded, _module, _import_reason
    if _loaded:  # set once, after _module: no lock on the hot path (every native launch asks)
        return _module
    with _lock:
        if not _loaded:
            _module, _import_reason = _import()
            _loaded = True
            if _module is None:
                logger.debug("nsa_cp native module unavailable: %s", _import_reason)
        return _module


def _import():
    try:
        return importlib.import_module("nsa_cp._C"), ""
    except ModuleNotFoundError as err:
        if err.name == "nsa_cp._C":
            return None, "nsa_cp._C was not built (pure Python install; build with nvcc, NSA_CP_BUILD_CUDA=1)"
        return None, f"nsa_cp._C failed to import: {type(err).__name__}: {err}"
    except Exception as err:  # ImportError (bad .so, ABI mismatch), OSError, anything from module init
        return None, f"nsa_cp._C failed to import: {type(err).__name__}: {err}"


def available() -> bool:
    """True when ``nsa_cp._C`` imports and at least one CUDA device is visible (cached)."""
    global _checked, _available, _reason
    if _checked:
        return _available
    mod = load()
    with _lock:
        if _checked:
            return _available
        if mod is None:
            _available, _reason = False, _import_reason
        else:
            try:
                count = mod.device_count()
            except Exception as err:  # a CUDA failure other than "no device / no driver"
                count, detail = 0, f"{type(err).__name__}: {err}"
            else:
                detail = mod.device_status() if count == 0 else ""
            if count > 0:
                _available, _reason = True, ""
            else:
                _available, _reason = False, f"no CUDA device visible ({detail})"
        _checked = True
        if not _available:
            logger.info("nsa_cp native kernels unavailable: %s", _reason)
        return _available


def support() -> Support:
    """Whether the kernels of ``nsa_cp._C`` can run in this process (:func:`available`), and why not."""
    return Support.yes() if available() else Support.no(_reason)


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (a sentence), None when it is True: ``support().reason`` for messages."""
    return support().reason or None


def device_support(index: int) -> Support:
    """Whether the kernels of ``nsa_cp._C`` load on ``cuda:index``, and why not (cached per device).

    The module holds machine code for its build's archs (e.g. sm_90a) and PTX of the lowest, so a GPU
    of an older architecture (an A100) has none it can run: loading every kernel once on that device
    (``kernel_info``) says so before any launch would fail, and the callers take another path.
    """
    verdict = _device_verdicts.get(index)
    if verdict is not None:
        return verdict
    verdict = support()
    if verdict:
        try:
            _load_kernels_on(index)
        except RuntimeError as err:
            verdict = Support.no(f"nsa_cp._C (built for {getattr(_module, 'CUDA_ARCHS', '?')}) has no kernels for "
                                 f"cuda:{index}: {err}")
            logger.info("nsa_cp native kernels unavailable on cuda:%d: %s", index, verdict.reason)
    _device_verdicts[index] = verdict
    return verdict


def _load_kernels_on(index: int) -> None:
    with torch.cuda.device(index):
        _module.kernel_info()  # cudaFuncGetAttributes of every kernel: fails without a usable image


_device_verdicts: dict = {}


def current_stream(device) -> int:
    """The cudaStream_t of torch's current stream on ``device`` (a CUDA ``torch.device``), as the int
    ``_C``'s launchers take.

    ``torch._C._cuda_getCurrentRawStream`` (what Triton's launcher uses) returns it without building a
    ``torch.cuda.Stream``, a fraction of the public route's host time (docs/performance.md, "Figures
    behind the code's choices"). The public route is the fallback should it ever go.
    """
    if _raw_stream is not None:
        return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_getter():
    """A function ``index -> cudaStream_t`` (int) of torch's current stream on ``cuda:index``, for hot
    paths that bind it once: ``torch._C._cuda_getCurrentRawStream`` itself where it exists (no Python
    frame in between), else the public route."""
    if _raw_stream is not None:
        return _raw_stream
    return lambda index: torch.cuda.current_stream(index).cuda_stream


def launch_device(device):
    """A context that makes ``device`` current for a launch through ``_C`` (which launches on the
    current device, on the stream it is given): a no-op when it already is, as in a process that called
    ``torch.cuda.set_device``, else ``torch.cuda.device(device)``, as torch's own kernels do."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return contextlib.nullcontext() if index == torch.cuda.current_device() else torch.cuda.device(index)


def _reset_for_tests() -> None:
    """Forget cached results (tests that monkeypatch the import)."""
    global _loaded, _module, _import_reason, _checked, _available, _reason
    with _lock:
        _loaded, _module, _import_reason = False, None, ""
        _checked, _available, _reason = False, False, ""
        _device_verdicts.clear()
