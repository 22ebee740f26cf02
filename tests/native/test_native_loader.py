"""nsa_cp.rows._native, the loader of the optional native module: it answers (module or None, available or
not, why not) and never raises, whatever the build or the machine. No GPU needed."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from nsa_cp.rows import _native


# ---- nsa_cp.rows._native ---------------------------------------------------------------------------------


@pytest.fixture
def fresh_native():
    _native._reset_for_tests()
    yield _native
    _native._reset_for_tests()


def test_native_answers_without_raising(fresh_native):
    mod = fresh_native.load()
    assert mod is None or hasattr(mod, "device_count")
    ok = fresh_native.available()
    assert isinstance(ok, bool)
    reason, verdict = fresh_native.unavailable_reason(), fresh_native.support()
    assert bool(verdict) == ok
    if ok:
        assert reason is None and verdict.reason == "", (reason, verdict)
    else:
        assert isinstance(reason, str) and reason.strip(), "unavailable_reason() must say why"
        assert verdict.reason == reason


def _fake_import(monkeypatch, result):
    real = importlib.import_module

    def fake(name, *args, **kwargs):
        if name != "nsa_cp._C":
            return real(name, *args, **kwargs)
        if isinstance(result, BaseException):
            raise result
        return result

    monkeypatch.setattr(importlib, "import_module", fake)


def test_reason_when_not_built(fresh_native, monkeypatch):
    _fake_import(monkeypatch, ModuleNotFoundError("No module named 'nsa_cp._C'", name="nsa_cp._C"))
    assert fresh_native.load() is None
    assert fresh_native.available() is False
    assert "nsa_cp._C was not built (pure Python install" in fresh_native.unavailable_reason()


@pytest.mark.parametrize(
    "error",
    [ImportError("_C.so: undefined symbol: foo"), OSError("libstdc++.so.6: version not found"), RuntimeError("init")],
)
def test_reason_when_import_fails(fresh_native, monkeypatch, error):
    _fake_import(monkeypatch, error)
    assert fresh_native.load() is None
    assert not fresh_native.available()
    reason = fresh_native.unavailable_reason()
    assert reason.startswith("nsa_cp._C failed to import") and str(error) in reason


class _FakeC:
    def __init__(self, count=0, status="cudaErrorNoDevice: no CUDA-capable device is detected", raises=None):
        self._count, self._status, self._raises = count, status, raises

    def device_count(self):
        if self._raises:
            raise self._raises
        return self._count

    def device_status(self):
        return self._status


def test_reason_without_device(fresh_native, monkeypatch):
    _fake_import(monkeypatch, _FakeC(0))
    assert fresh_native.load() is not None
    assert fresh_native.available() is False
    reason = fresh_native.unavailable_reason()
    assert reason.startswith("no CUDA device visible") and "cudaErrorNoDevice" in reason


def test_reason_when_device_query_fails(fresh_native, monkeypatch):
    _fake_import(monkeypatch, _FakeC(raises=RuntimeError("device_count: cudaGetDeviceCount failed: boom")))
    assert fresh_native.available() is False
    assert "boom" in fresh_native.unavailable_reason()


def test_available_with_a_device(fresh_native, monkeypatch):
    _fake_import(monkeypatch, _FakeC(2, "ok"))
    assert fresh_native.available() is True
    assert fresh_native.unavailable_reason() is None and fresh_native.support()


def test_device_reason_when_the_kernels_do_not_load_there(fresh_native, monkeypatch):
    """A GPU the build has no machine code or PTX for (e.g. an A100 for a 90a build): the kernels fail
    to load there, which is said once per device and cached, before any launch could fail."""
    _fake_import(monkeypatch, _FakeC(2, "ok"))
    tried = []

    def no_image(index):
        tried.append(index)
        raise RuntimeError("kernel_info: cudaFuncGetAttributes failed: cudaErrorNoKernelImageForDevice: no kernel image")

    monkeypatch.setattr(fresh_native, "_load_kernels_on", no_image)
    verdict = fresh_native.device_support(1)
    reason = verdict.reason
    assert not verdict and reason.startswith("nsa_cp._C (built for ?) has no kernels for cuda:1") and "NoKernelImage" in reason
    assert fresh_native.device_support(1).reason == reason and tried == [1]  # cached
    monkeypatch.setattr(fresh_native, "_load_kernels_on", lambda index: tried.append(index))
    assert fresh_native.device_support(0) and fresh_native.device_support(0).reason == "" and tried == [1, 0]


def test_device_reason_without_the_module(fresh_native, monkeypatch):
    _fake_import(monkeypatch, ModuleNotFoundError("x", name="nsa_cp._C"))
    verdict = fresh_native.device_support(0)
    assert not verdict and "nsa_cp._C was not built" in verdict.reason


def test_native_logs_instead_of_printing(fresh_native, monkeypatch, caplog, capsys):
    _fake_import(monkeypatch, ModuleNotFoundError("x", name="nsa_cp._C"))
    with caplog.at_level("DEBUG", logger="nsa_cp"):
        fresh_native.available()
    assert capsys.readouterr() == ("", "")
    assert any("not built" in rec.getMessage() for rec in caplog.records)
