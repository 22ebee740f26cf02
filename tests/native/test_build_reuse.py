"""setup.py's choices around the in-tree ``nsa_cp._C``: archs asked for by name with no nvcc are an error,
an editable reinstall with unchanged sources reuses the module (its stamp says so), and a pure build
removes an in-tree module that an editable install would otherwise still import. No GPU, no nvcc, no
CMake needed: a fake cmake stands in for the build."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXT_NAME = "_C" + sysconfig.get_config_var("EXT_SUFFIX")




# ---- NSA_CP_CUDA_ARCHS without nvcc ------------------------------------------------------------------


def test_archs_asked_for_without_nvcc_is_an_error_that_says_what_to_do(setup_py):
    with pytest.raises(setup_py.BuildConfigError) as info:
        setup_py.build_cuda_decision({"NSA_CP_CUDA_ARCHS": "90a;100a"}, None)
    message = str(info.value)
    assert "NSA_CP_CUDA_ARCHS='90a;100a'" in message and "nvcc was not found" in message
    assert "CUDA toolkit" in message and "CUDA_HOME" in message  # how to get the native wheel
    assert "unset NSA_CP_CUDA_ARCHS" in message and "NSA_CP_BUILD_CUDA=0" in message  # how to get a pure one
    # a pure build asked for by name stays pure; blank archs are the default, not a request
    assert setup_py.build_cuda_decision({"NSA_CP_CUDA_ARCHS": "90a", "NSA_CP_BUILD_CUDA": "0"}, None)[0] is False
    assert setup_py.build_cuda_decision({"NSA_CP_CUDA_ARCHS": "  "}, None)[0] is False
    assert setup_py.build_cuda_decision({"NSA_CP_CUDA_ARCHS": "90a"}, "/opt/cuda/bin/nvcc") == (True, "nvcc found")


def test_setup_py_exits_nonzero_for_archs_without_nvcc(setup_py, monkeypatch, capsys):
    """What `NSA_CP_CUDA_ARCHS=... pip wheel .` runs: main() fails before setup(), with the message."""
    monkeypatch.setattr(setup_py, "find_nvcc", lambda env=None: None)  # this machine may have /usr/local/cuda
    monkeypatch.setenv("NSA_CP_CUDA_ARCHS", "90a;100a")
    monkeypatch.delenv("NSA_CP_BUILD_CUDA", raising=False)
    with pytest.raises(SystemExit) as info:
        setup_py.main()
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "nsa_cp build error" in err and "install the CUDA toolkit" in err and "NSA_CP_BUILD_CUDA=0" in err


# ---- the stamp ----------------------------------------------------------------------------------------


def _tree(root: Path) -> Path:
    (root / "nsa_cp").mkdir(parents=True)
    (root / "nsa_cp" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    (root / "csrc").mkdir()
    (root / "csrc" / "a.cu").write_text("// a\n")
    (root / "csrc" / "b.h").write_text("// b\n")
    (root / "CMakeLists.txt").write_text("# cmake\n")
    return root


def test_source_digest_follows_sources_and_flags(setup_py, tmp_path):
    root = _tree(tmp_path / "tree")
    base = setup_py.source_digest(root, ["-DNSA_CP_CUDA_ARCHS=90a"])
    assert base == setup_py.source_digest(root, ["-DNSA_CP_CUDA_ARCHS=90a"])
    assert base != setup_py.source_digest(root, ["-DNSA_CP_CUDA_ARCHS=90a;100a"])
    for changed in (root / "csrc" / "b.h", root / "CMakeLists.txt"):
        before = changed.read_text()
        changed.write_text(before + "// edited\n")
        assert setup_py.source_digest(root, ["-DNSA_CP_CUDA_ARCHS=90a"]) != base, changed.name
        changed.write_text(before)
    (root / "csrc" / "new.cuh").write_text("")
    assert setup_py.source_digest(root, ["-DNSA_CP_CUDA_ARCHS=90a"]) != base

    module = root / "nsa_cp" / EXT_NAME
    assert not setup_py.reusable_build(module, base)  # no module, no stamp
    module.write_bytes(b"so")
    assert not setup_py.reusable_build(module, base)  # a module without a stamp is rebuilt
    (module.parent / setup_py.STAMP_NAME).write_text(setup_py.stamp_text(module, base))
    assert setup_py.reusable_build(module, base)
    assert not setup_py.reusable_build(module, "0" * 64)


FAKE_CMAKE = """#!{python}
# Stands in for cmake: --version, configure (remembers the output dir), --build (writes the module).
import pathlib, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("cmake version 3.28.0")
elif args[0] == "-S":
    build = pathlib.Path(args[args.index("-B") + 1])
    out = next(a.split("=", 1)[1] for a in args if a.startswith("-DNSA_CP_OUTPUT_DIR="))
    (build / "out").write_text(out)
else:
    build = pathlib.Path(args[1])
    pathlib.Path((build / "out").read_text(), {name!r}).write_text("built from " + {log!r})
    with open({log!r}, "a") as log:
        log.write("build\\n")
"""


def _editable_build(setup_py, root: Path, work: Path) -> None:
    """setuptools' build_ext as `pip install -e .` runs it (in place), with setup.py's CMakeBuild."""
    from setuptools import Distribution, Extension

    class Plan:
        nvcc, archs, cuda_version = "/opt/cuda/bin/nvcc", ["90a"], (13, 0)

    dist = Distribution({"name": "nsa_cp", "packages": ["nsa_cp"],
                         "ext_modules": [Extension("nsa_cp._C", sources=[])]})
    cmd = setup_py._make_cmdclass(Plan())["build_ext"](dist)
    cmd.inplace = True
    cmd.build_temp, cmd.build_lib = str(work / "temp"), str(work / "lib")
    cmd.ensure_finalized()
    cmd.run()


def test_editable_reinstall_reuses_an_unchanged_module(setup_py, tmp_path, monkeypatch):
    root = _tree(tmp_path / "tree")
    log = tmp_path / "builds.log"
    cmake = tmp_path / "cmake"
    cmake.write_text(FAKE_CMAKE.format(python=sys.executable, name=EXT_NAME, log=str(log)))
    cmake.chmod(0o755)
    monkeypatch.setattr(setup_py, "ROOT", root)
    monkeypatch.setattr(setup_py, "find_cmake", lambda: str(cmake))
    monkeypatch.chdir(root)  # setuptools finds the package (and puts the in-place module) relative to it
    module, stamp = root / "nsa_cp" / EXT_NAME, root / "nsa_cp" / setup_py.STAMP_NAME

    _editable_build(setup_py, root, tmp_path / "w1")
    assert module.is_file() and stamp.is_file() and log.read_text().count("build") == 1
    _editable_build(setup_py, root, tmp_path / "w2")  # a fresh build folder, as pip's editable builds get
    assert log.read_text().count("build") == 1, "unchanged sources and flags: no second build"
    assert module.is_file() and stamp.is_file()

    (root / "csrc" / "a.cu").write_text("// a, edited\n")
    _editable_build(setup_py, root, tmp_path / "w3")
    assert log.read_text().count("build") == 2, "an edited source must rebuild"
    monkeypatch.setenv("CMAKE_ARGS", "-DNSA_CP_PTXAS_VERBOSE=ON")
    _editable_build(setup_py, root, tmp_path / "w4")
    assert log.read_text().count("build") == 3, "other CMake arguments must rebuild"


# ---- a pure build removes the in-tree module ------------------------------------------------------------


def test_remove_in_tree_native(setup_py, tmp_path):
    root = _tree(tmp_path / "tree")
    module = root / "nsa_cp" / EXT_NAME
    module.write_bytes(b"so")
    (root / "nsa_cp" / setup_py.STAMP_NAME).write_text("stamp")
    removed = setup_py.remove_in_tree_native(root)
    assert sorted(p.name for p in removed) == sorted([EXT_NAME, setup_py.STAMP_NAME])
    assert sorted(p.name for p in (root / "nsa_cp").iterdir()) == ["__init__.py"]
    assert setup_py.remove_in_tree_native(root) == []


def _tree_copy(root: Path) -> Path:
    """setup.py and what it reads, copied, with an earlier native build's module in nsa_cp/."""
    (root / "nsa_cp").mkdir(parents=True)
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "nsa_cp/__init__.py"):
        shutil.copy(ROOT / name, root / name)
    (root / "nsa_cp" / EXT_NAME).write_bytes(b"an earlier build")
    return root


def _setup_py(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "NSA_CP_BUILD_CUDA": "0", "HOME": str(root.parent)}
    proc = subprocess.run([sys.executable, "setup.py", *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_pure_editable_install_removes_a_stale_in_tree_module(tmp_path):
    """`NSA_CP_BUILD_CUDA=0 pip install -e .` after a native build: setup.py's editable_wheel (what pip runs
    for it; here on a copy of the tree's build files) removes nsa_cp/_C*.so, so the editable install cannot
    import the old module."""
    root = _tree_copy(tmp_path / "tree")
    proc = _setup_py(root, "editable_wheel", "--dist-dir", str(tmp_path / "dist"))
    assert not (root / "nsa_cp" / EXT_NAME).exists()
    assert f"removed nsa_cp/{EXT_NAME}" in proc.stderr


def test_pure_wheel_leaves_an_editable_installs_module(tmp_path):
    """`NSA_CP_BUILD_CUDA=0 pip wheel .` (pip runs setup.py for the metadata, then bdist_wheel) in a checkout
    with an editable native install keeps that install's nsa_cp/_C*.so, and the pure wheel holds no _C."""
    import zipfile

    root = _tree_copy(tmp_path / "tree")
    module = root / "nsa_cp" / EXT_NAME
    _setup_py(root, "--version")
    (tmp_path / "meta").mkdir()
    _setup_py(root, "dist_info", "--output-dir", str(tmp_path / "meta"))
    proc = _setup_py(root, "bdist_wheel", "--dist-dir", str(tmp_path / "dist"))
    assert module.read_bytes() == b"an earlier build", "a pure wheel build removed the editable install's _C"
    assert "removed" not in proc.stderr
    (wheel,) = (tmp_path / "dist").glob("nsa_cp-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if "/_C" in n]
