"""``python -m nsa_cp`` (nsa_cp/__main__.py): --help, every variable, and what this machine can run (nsa_cp._C, P2P, the
native NCCL communicator) with the reason when not; ``nsa_cp.__version__`` against the installed
distribution (a fake dist-info on PYTHONPATH stands in for an install)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nsa_cp
from nsa_cp import envs
from nsa_cp.rows import _native
from nsa_cp.__main__ import machine_report, main
from nsa_cp.support import Support

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, pythonpath=None, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*(pythonpath or []), str(ROOT)]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def test_help():
    proc = _run("-m", "nsa_cp", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m nsa_cp")
    assert "RuntimeWarning" not in proc.stderr, proc.stderr  # the CLI is a module the package never imports
    for word in ("NSA_CP_*", "nsa_cp._C", "P2P transport", "NCCL communicator", "--vars-only"):
        assert word in proc.stdout, word


def test_report_lists_every_variable_and_the_machine():
    proc = _run("-m", "nsa_cp")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name in envs.ENVIRONMENT_VARIABLES:
        assert f"\n{name}=" in "\n" + out, name
    lines = dict(line.split(": ", 1) for line in out.split("# this machine\n", 1)[1].splitlines())
    assert lines["nsa_cp"].startswith(nsa_cp.__version__)
    if _native.load() is None:
        reason = _native.unavailable_reason()
        assert reason and lines["nsa_cp._C"] == f"not loaded: {reason}"
        assert lines["P2P transport"] == f"no: {reason}"
        assert lines["native NCCL communicator"] == f"no: {reason}"
    else:
        assert lines["nsa_cp._C"].startswith("loaded (")
        if not _native.available():  # built, no GPU: say so
            assert lines["P2P transport"] == f"no: {_native.unavailable_reason()}"
        else:
            assert lines["P2P transport"].startswith(("yes", "no"))
        assert lines["native NCCL communicator"].startswith(("yes", "no"))


@pytest.mark.parametrize("opens", [True, False])
def test_report_where_the_extension_serves(monkeypatch, opens):
    """The branch a GPU machine takes (nsa_cp._C loaded and usable), on any machine: a stand-in module."""
    seen = []

    class FakeC:
        NcclComm = object

        @staticmethod
        def nccl_library(path):
            seen.append(path)
            if not opens:
                raise RuntimeError("nccl_library: cannot open libnccl.so.2")
            return "libnccl.so.2"

    monkeypatch.setattr(_native, "load", lambda: FakeC)
    monkeypatch.setattr(_native, "available", lambda: True)
    monkeypatch.setattr(_native, "device_support", lambda i: Support.yes())
    monkeypatch.setenv("NSA_CP_NCCL_LIBRARY", "libnccl.so.2")
    report = machine_report()
    assert seen == ["libnccl.so.2"]  # the variable's value reaches the loader
    assert report["P2P transport"].startswith("yes")
    want = "yes" if opens else "no: nccl_library: cannot open"
    assert report["native NCCL communicator"].startswith(want), report


def test_vars_only_and_bad_arguments(capsys):
    assert main(["--vars-only"]) == 0
    out = capsys.readouterr().out
    assert "# this machine" not in out and "NSA_CP_BACKEND=" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["--bogus"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def _fake_install(tmp_path, version, url):
    info = tmp_path / f"nsa_cp-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nsa_cp\nVersion: {version}\n")
    (info / "direct_url.json").write_text(json.dumps({"url": url, "dir_info": {"editable": True}}))
    return str(tmp_path)


def _source_version():
    import re

    return re.search(r'^__version__ = "([^"]+)"', (ROOT / "nsa_cp" / "__init__.py").read_text(), re.M).group(1)


@pytest.mark.parametrize("installed,url,expected", [
    ("{base}+cu13", "file://{root}", "{base}+cu13"),   # pip install -e . of this checkout, with nsa_cp._C
    ("{base}", "file://{root}", "{base}"),             # a pure build
    ("{base}+cu13", "file:///elsewhere/nsa_cp", "{base}"),  # another checkout's install
    ("0.0.1+cu13", "file://{root}", "{base}"),         # a stale install of another version
], ids=["editable-cuda", "editable-pure", "other-checkout", "other-version"])
def test_version_is_the_installed_distributions(tmp_path, monkeypatch, installed, url, expected):
    """importlib.metadata finds the (fake) dist-info first on sys.path, as it would an installed one."""
    fill = {"base": _source_version(), "root": ROOT}
    monkeypatch.syspath_prepend(_fake_install(tmp_path, installed.format(**fill), url.format(**fill)))
    assert nsa_cp._installed_version(fill["base"]) == expected.format(**fill)


def test_version_of_a_fresh_import(tmp_path):
    """What ``import nsa_cp`` sets, in a fresh process with the fake editable install of this checkout."""
    base = _source_version()
    path = _fake_install(tmp_path, f"{base}+cu13", f"file://{ROOT}")
    # run from elsewhere: with -c the working directory is first on sys.path, and a checkout's build metadata
    # (nsa_cp.egg-info, the real install's version) would be found before the fake one
    proc = _run("-c", "import nsa_cp; print(nsa_cp.__version__)", pythonpath=[path], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{base}+cu13"
    from importlib import metadata

    try:
        metadata.distribution("nsa_cp")
    except metadata.PackageNotFoundError:
        assert nsa_cp.__version__ == base  # not installed here: the source line
    else:
        assert nsa_cp.__version__.split("+")[0] == base


def test_skip_reasons_show_without_flags(tmp_path):
    """pyproject's addopts has -rs: a plain ``python -m pytest`` lists each skip with its reason."""
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n\ndef test_needs_a_gpu():\n    pytest.skip('needs 2 CUDA GPUs, found 0')\n")
    proc = _run("-m", "pytest", str(tmp_path / "test_skips.py"), "-c", str(ROOT / "pyproject.toml"),
                "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SKIPPED [1]" in proc.stdout and "needs 2 CUDA GPUs, found 0" in proc.stdout, proc.stdout
