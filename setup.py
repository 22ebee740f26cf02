"""Build of nsa_cp: always the pure Python + Triton package; nsa_cp._C too when nvcc is found.

    pip install --no-deps --no-build-isolation -e .     # editable: _C lands in nsa_cp/ in the tree
    pip wheel . --no-deps -w dist                        # wheel with nsa_cp/_C*.so (platform tag)

An editable install reuses the in-tree _C while csrc/, CMakeLists.txt and the build flags are unchanged
(a stamp beside it, _C.build-stamp, records them); a pure editable install (or `setup.py develop`)
removes an in-tree _C (and its stamp), which it would otherwise still import. A pure `pip wheel .` or
`pip install .` leaves the tree alone: an editable install of the same checkout keeps its _C.

Environment (documented with the others in nsa_cp/envs.py):
    NSA_CP_BUILD_CUDA   auto (default): build _C when nvcc is found; 1: must build (error without
                        nvcc); 0: never (pure package, py3-none-any wheel).
    NSA_CP_CUDA_ARCHS   ';'-separated archs, e.g. "90a;100a". Default: 90a, plus 100a when nvcc
                        knows compute_100(a). Set while nvcc is not found: an error (asked-for archs
                        are never dropped silently), unless NSA_CP_BUILD_CUDA=0.
    CUDA_HOME / CUDA_PATH  where to look for nvcc first (then /usr/local/cuda, then PATH).
    CMAKE_ARGS          extra CMake arguments, e.g. "-DNSA_CP_PTXAS_VERBOSE=ON".

The version is nsa_cp/__init__.py's __version__ (read as text: the package is not imported) plus a
local tag naming the CUDA major and the GPU archs when _C is built, e.g. 0.2.0+cu13.sm90a.sm100a, so a
wheel's file name says which GPUs it has machine code for; the installed package's nsa_cp.__version__
reports that full version (read back from the distribution's metadata).

setuptools >= 77 (pyproject.toml's SPDX `license` string): isolated builds get it from
[build-system]; a build without isolation checks the environment's and says what to do.

The helpers below are plain functions so tests can import this file (importlib) without building.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent
PACKAGE = "nsa_cp"
MIN_CMAKE = (3, 24)
MIN_SETUPTOOLS = (77, 0)  # reads pyproject.toml's SPDX `license` string (older: a schema error)
DEFAULT_ARCHS = ("90a",)
OPTIONAL_ARCHS = ("100a",)  # added by default when nvcc supports them
_ARCH_RE = re.compile(r"^(\d+)([af]?)$")


class BuildConfigError(RuntimeError):
    """A build setting that cannot be satisfied (reported with what to change)."""


# ---- version -------------------------------------------------------------------------------------


def read_base_version(root: Path = ROOT) -> str:
    """__version__ of nsa_cp/__init__.py, read as text."""
    text = (root / PACKAGE / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.MULTILINE)
    if not match:
        raise BuildConfigError(f"no __version__ = '...' line in {root / PACKAGE / '__init__.py'}")
    return match.group(1)


def full_version(base: str, cuda_major: Optional[int], archs: Sequence[str] = ()) -> str:
    """'0.1.0' for a pure build; '0.1.0+cu13.sm90a.sm100a' when _C is built with CUDA 13.x for archs
    ['90a', '100a'] (PEP 440 local segments, so the wheel's file name carries them); without archs
    '0.1.0+cu13'."""
    if cuda_major is None:
        return base
    tag = ".".join([f"cu{cuda_major}", *(f"sm{arch}" for arch in archs)])
    return f"{base}.{tag}" if "+" in base else f"{base}+{tag}"


def check_setuptools(version: str) -> None:
    """BuildConfigError when ``version`` (setuptools.__version__) is below MIN_SETUPTOOLS."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and (int(match.group(1)), int(match.group(2))) < MIN_SETUPTOOLS:
        raise BuildConfigError(
            f"setuptools {version} is too old: nsa_cp's pyproject.toml gives its license as an SPDX string, which "
            f"setuptools reads from {MIN_SETUPTOOLS[0]} on. Upgrade it in this environment (python -m pip install "
            f"'setuptools>={MIN_SETUPTOOLS[0]}'), or build with isolation (no --no-build-isolation), which takes it "
            "from pyproject.toml's [build-system]"
        )


# ---- nvcc ----------------------------------------------------------------------------------------


def find_nvcc(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """nvcc from CUDA_HOME, CUDA_PATH, /usr/local/cuda, then PATH; None if there is none."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            candidates.append(Path(env[var]) / "bin" / "nvcc")
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for cand in candidates:
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("nvcc", path=env.get("PATH", os.defpath))


def _run(cmd: Sequence[str]) -> str:
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True).stdout


def parse_nvcc_version(text: str) -> Tuple[int, int]:
    """(major, minor) from `nvcc --version` output ('... release 13.0, V13.0.88')."""
    match = re.search(r"release (\d+)\.(\d+)", text)
    if not match:
        raise BuildConfigError(f"cannot read the CUDA version from nvcc --version output: {text.strip()!r}")
    return int(match.group(1)), int(match.group(2))


def nvcc_version(nvcc: str) -> Tuple[int, int]:
    return parse_nvcc_version(_run([nvcc, "--version"]))


def parse_gpu_arch_list(text: str) -> List[str]:
    """The compute_XX names of `nvcc --list-gpu-arch` output."""
    return re.findall(r"compute_\d+[af]?", text)


def nvcc_gpu_archs(nvcc: str) -> List[str]:
    try:
        return parse_gpu_arch_list(_run([nvcc, "--list-gpu-arch"]))
    except (OSError, subprocess.CalledProcessError):
        return []  # older nvcc without the flag: no optional archs


# ---- archs ---------------------------------------------------------------------------------------


def parse_archs(spec: str) -> List[str]:
    """'90a;100a' -> ['90a', '100a']. Also takes ',' or spaces, 'sm_90a' / 'compute_90a', '9.0a'.

    Order is kept, duplicates dropped; anything else raises BuildConfigError.
    """
    archs: List[str] = []
    for raw in re.split(r"[;,\s]+", spec.strip()):
        if not raw:
            continue
        item = raw.lower()
        for prefix in ("sm_", "compute_"):
            if item.startswith(prefix):
                item = item[len(prefix) :]
        item = re.sub(r"^(\d+)\.(\d)", r"\1\2", item)  # 9.0a -> 90a, 10.0a -> 100a
        if not _ARCH_RE.match(item):
            raise BuildConfigError(f"NSA_CP_CUDA_ARCHS: bad arch {raw!r} (expected e.g. '90a', '100a', '90')")
        if item not in archs:
            archs.append(item)
    if not archs:
        raise BuildConfigError("NSA_CP_CUDA_ARCHS is empty (expected e.g. '90a;100a')")
    return archs


def default_archs(supported: Sequence[str]) -> List[str]:
    """90a, plus 100a when nvcc can build it.

    `nvcc --list-gpu-arch` names the base archs (compute_100); the arch-specific 'a' variant of a
    listed base exists from 9.0 on, so compute_100 counts as support for 100a.
    """
    archs = list(DEFAULT_ARCHS)
    names = set(supported)
    for arch in OPTIONAL_ARCHS:
        base = _ARCH_RE.match(arch).group(1)
        if f"compute_{arch}" in names or f"compute_{base}" in names:
            archs.append(arch)
    return archs


def resolve_archs(env: Mapping[str, str], supported: Sequence[str]) -> List[str]:
    """NSA_CP_CUDA_ARCHS if set (checked against nvcc's list when there is one), else the default."""
    spec = env.get("NSA_CP_CUDA_ARCHS", "").strip()
    if not spec:
        return default_archs(supported)
    archs = parse_archs(spec)
    if supported:
        names = set(supported)
        for arch in archs:
            base = _ARCH_RE.match(arch).group(1)
            if f"compute_{arch}" not in names and f"compute_{base}" not in names:
                raise BuildConfigError(
                    f"NSA_CP_CUDA_ARCHS: this nvcc cannot build {arch!r} (it lists {' '.join(sorted(names))})"
                )
    return archs


# ---- build decision ------------------------------------------------------------------------------


def build_cuda_decision(env: Mapping[str, str], nvcc: Optional[str]) -> Tuple[bool, str]:
    """(build _C?, why) from NSA_CP_BUILD_CUDA (auto/0/1) and whether nvcc was found."""
    value = env.get("NSA_CP_BUILD_CUDA", "").strip().lower() or "auto"
    if value == "0":
        return False, "NSA_CP_BUILD_CUDA=0"
    if value == "1":
        if nvcc is None:
            raise BuildConfigError(
                "NSA_CP_BUILD_CUDA=1 but nvcc was not found (looked in $CUDA_HOME/bin, $CUDA_PATH/bin, "
                "/usr/local/cuda/bin and PATH); install the CUDA toolkit, point CUDA_HOME at it, or set "
                "NSA_CP_BUILD_CUDA=0 for the pure Python package"
            )
        return True, "NSA_CP_BUILD_CUDA=1"
    if value != "auto":
        raise BuildConfigError(f"NSA_CP_BUILD_CUDA must be auto, 0 or 1, got {env['NSA_CP_BUILD_CUDA']!r}")
    if nvcc is None:
        archs = env.get("NSA_CP_CUDA_ARCHS", "").strip()
        if archs:  # archs asked for by name: a pure wheel would silently lack them (and P2P)
            raise BuildConfigError(
                f"NSA_CP_CUDA_ARCHS={archs!r} asks for nsa_cp._C, but nvcc was not found (looked in "
                "$CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin and PATH). For the native wheel install "
                "the CUDA toolkit or point CUDA_HOME at it; for the pure Python package (no P2P, no native "
                "kernels) unset NSA_CP_CUDA_ARCHS or set NSA_CP_BUILD_CUDA=0"
            )
        return False, "nvcc not found (set CUDA_HOME, or NSA_CP_BUILD_CUDA=1 to make this an error)"
    return True, "nvcc found"


# ---- cmake ---------------------------------------------------------------------------------------


def find_cmake() -> Optional[str]:
    """cmake on PATH, else the one of the `cmake` Python package."""
    found = shutil.which("cmake")
    if found:
        return found
    try:
        import cmake  # type: ignore

        cand = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        return str(cand) if cand.exists() else None
    except Exception:
        return None


def parse_cmake_version(text: str) -> Tuple[int, ...]:
    match = re.search(r"cmake version (\d+)\.(\d+)", text)
    if not match:
        raise BuildConfigError(f"cannot read the version from cmake --version output: {text.strip()!r}")
    return int(match.group(1)), int(match.group(2))


# ---- the in-tree module: reused while unchanged, removed when the build is pure -------------------

STAMP_NAME = "_C.build-stamp"  # beside the in-tree module: its name and the digest it was built from


def source_digest(root: Path, config: Sequence[str]) -> str:
    """sha256 (hex) of what _C is built from: ``config`` (compiler, interpreter, archs, CMAKE_ARGS, tool
    versions, module file name, one string each), CMakeLists.txt and every file under csrc/ (by relative
    name and bytes, in sorted order)."""
    digest = hashlib.sha256()
    for item in config:
        digest.update(item.encode() + b"\0")
    files = [root / "CMakeLists.txt", *sorted(p for p in (root / "csrc").rglob("*") if p.is_file())]
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def stamp_text(module: Path, digest: str) -> str:
    return f"{module.name} {digest}\n"


def reusable_build(module: Path, digest: str) -> bool:
    """True when ``module`` exists and the stamp beside it says it was built from ``digest``."""
    try:
        return module.is_file() and (module.parent / STAMP_NAME).read_text() == stamp_text(module, digest)
    except OSError:
        return False


def remove_in_tree_native(root: Path = ROOT) -> List[Path]:
    """Delete an earlier build's nsa_cp/_C*.so (and its stamp) from the source tree; the paths removed.

    An editable install imports the package from the tree, so a pure editable install that left the module
    there would still load it: kernels of older sources, in an install whose version says it has none.
    Only the in-tree installs call it (``_make_pure_cmdclass``): a pure wheel built in the same checkout
    must not take _C from an editable install of it.
    """
    removed = []
    for path in sorted((root / PACKAGE).glob("_C*.so")) + [root / PACKAGE / STAMP_NAME]:
        if path.is_file():
            path.unlink()
            removed.append(path)
    return removed


def _pybind11_version() -> str:
    try:
        import pybind11  # type: ignore

        return pybind11.__version__
    except Exception:
        return "?"


class BuildPlan:
    """Everything decided before setup(): what to build, how, and the version."""

    def __init__(self, env: Mapping[str, str] = os.environ, root: Path = ROOT):
        self.base_version = read_base_version(root)
        self.nvcc = find_nvcc(env)
        self.build_cuda, self.reason = build_cuda_decision(env, self.nvcc)
        self.cuda_version: Optional[Tuple[int, int]] = None
        self.archs: List[str] = []
        if self.build_cuda:
            self.cuda_version = nvcc_version(self.nvcc)
            self.archs = resolve_archs(env, nvcc_gpu_archs(self.nvcc))
        self.version = full_version(self.base_version, self.cuda_version[0] if self.cuda_version else None,
                                    self.archs)

    def summary(self) -> str:
        lines = ["nsa_cp build summary", f"  version : {self.version}"]
        if self.nvcc:
            ver = self.cuda_version or _safe_nvcc_version(self.nvcc)
            lines.append(f"  nvcc    : {self.nvcc} (CUDA {ver[0]}.{ver[1]})" if ver else f"  nvcc    : {self.nvcc}")
        else:
            lines.append("  nvcc    : not found")
        if self.build_cuda:
            lines.append(f"  archs   : {';'.join(self.archs)} (+ PTX of the lowest)")
            lines.append(f"  builds  : nsa_cp._C (CUDA kernels) + pure Python/Triton package ({self.reason})")
        else:
            lines.append(f"  builds  : pure Python/Triton package only; nsa_cp._C skipped: {self.reason}")
        return "\n".join(lines)


def _safe_nvcc_version(nvcc: str) -> Optional[Tuple[int, int]]:
    try:
        return nvcc_version(nvcc)
    except Exception:
        return None


def _log(text: str) -> None:
    # stderr: pip shows it with -v, and it stays out of any captured stdout protocol.
    print(text, file=sys.stderr, flush=True)


# ---- setuptools glue (imported lazily so tests need no setuptools internals) ---------------------


def _make_cmdclass(plan: BuildPlan):
    from setuptools.command.build_ext import build_ext

    class CMakeBuild(build_ext):
        """Configures and builds CMakeLists.txt, putting _C where setuptools expects the extension
        (build/lib; for editable installs setuptools then copies it into the package in the source tree).

        In-tree builds (editable installs, --inplace) skip CMake when the tree already holds a module
        built from the same sources and flags (its stamp, STAMP_NAME, says so): an unchanged
        ``pip install -e .`` reinstalls in seconds instead of recompiling every kernel. The stamp is
        written only after setuptools has copied the new module into the tree.
        """

        def run(self) -> None:
            self._nsa_cp_in_tree = bool(self.inplace or getattr(self, "editable_mode", False))
            self._nsa_cp_stamps: List[Tuple[Path, str]] = []
            super().run()  # builds (inplace set False meanwhile), then copies into the tree
            if self._nsa_cp_in_tree:
                for module, digest in self._nsa_cp_stamps:
                    if module.is_file():
                        (module.parent / STAMP_NAME).write_text(stamp_text(module, digest))

        def build_extension(self, ext) -> None:
            ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
            ext_path.parent.mkdir(parents=True, exist_ok=True)
            extra = shlex.split(os.environ.get("CMAKE_ARGS", ""))
            config = [
                f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
                f"-DCMAKE_CUDA_COMPILER={plan.nvcc}",
                f"-DPython3_EXECUTABLE={sys.executable}",
                f"-DNSA_CP_CUDA_ARCHS={';'.join(plan.archs)}",
                f"-DNSA_CP_OUTPUT_DIR={ext_path.parent}",
            ]
            # One build folder per configuration, so switching interpreters or archs never reuses a
            # stale CMake cache; an unchanged one rebuilds incrementally.
            key = hashlib.sha1("\n".join(config[:4] + extra).encode()).hexdigest()[:10]
            if getattr(self, "_nsa_cp_in_tree", False):  # set by run(); a direct call builds as before
                in_tree = ROOT / PACKAGE / ext_path.name
                digest = source_digest(ROOT, config[:4] + extra + [
                    f"cuda {plan.cuda_version}", f"pybind11 {_pybind11_version()}", ext_path.name])
                if reusable_build(in_tree, digest):
                    if in_tree != ext_path:
                        shutil.copy2(in_tree, ext_path)  # where setuptools copies the module from
                    _log(f"nsa_cp: {in_tree} is up to date (csrc/, CMakeLists.txt and the build flags "
                         f"unchanged): not rebuilt (delete {STAMP_NAME} beside it to force a build)")
                    return
                (in_tree.parent / STAMP_NAME).unlink(missing_ok=True)  # a failed build leaves no stamp
                self._nsa_cp_stamps.append((in_tree, digest))
            cmake = find_cmake()
            if cmake is None:
                raise BuildConfigError("cmake >= 3.24 is needed to build nsa_cp._C (pip install cmake)")
            cmake_ver = parse_cmake_version(_run([cmake, "--version"]))
            if cmake_ver < MIN_CMAKE:
                raise BuildConfigError(f"cmake {cmake_ver} is too old: nsa_cp._C needs >= 3.24 (pip install cmake)")
            build_dir = Path(self.build_temp).resolve() / f"cmake-{key}"
            build_dir.mkdir(parents=True, exist_ok=True)
            generator = ["-G", "Ninja"] if shutil.which("ninja") and not (build_dir / "Makefile").exists() else []
            _log(f"nsa_cp: cmake {cmake_ver[0]}.{cmake_ver[1]} configuring in {build_dir}")
            subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir), *generator, *config, *extra], check=True)
            jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
            subprocess.run([cmake, "--build", str(build_dir), "--parallel", jobs], check=True)
            if not ext_path.exists():
                raise BuildConfigError(f"CMake finished but {ext_path} is missing")
            _log(f"nsa_cp: built {ext_path}")

    return {"build_ext": CMakeBuild}


def _make_distclass(plan: BuildPlan):
    from setuptools.dist import Distribution

    class VersionedDistribution(Distribution):
        """pyproject.toml's [tool.setuptools.dynamic] reads the plain __version__ and is applied after
        setup()'s arguments; put the +cuXX version back once it has been."""

        def parse_config_files(self, *args, **kwargs):
            super().parse_config_files(*args, **kwargs)
            self.metadata.version = plan.version

    return VersionedDistribution


def _make_pure_cmdclass():
    """The in-tree install commands of a pure build (``editable_wheel``: ``pip install -e .``; ``develop``),
    which first remove an earlier build's in-tree _C. Other commands (``bdist_wheel``, ``dist_info``,
    ``--version``) leave the tree as it is."""
    from setuptools.command.develop import develop
    from setuptools.command.editable_wheel import editable_wheel

    def removing(base):
        class RemovesInTreeNative(base):
            def run(self) -> None:
                removed = remove_in_tree_native()
                if removed:
                    _log(f"nsa_cp: removed {', '.join(str(p.relative_to(ROOT)) for p in removed)}: an earlier "
                         "build's nsa_cp._C, which this editable install would still import (this build is pure)")
                super().run()

        RemovesInTreeNative.__name__ = f"Pure{base.__name__}"
        return RemovesInTreeNative

    return {"editable_wheel": removing(editable_wheel), "develop": removing(develop)}


def setup_kwargs(plan: BuildPlan) -> Dict[str, object]:
    """Arguments for setuptools.setup(): the rest of the metadata is in pyproject.toml."""
    kwargs: Dict[str, object] = {"version": plan.version, "distclass": _make_distclass(plan)}
    if plan.build_cuda:
        from setuptools import Extension

        # No sources: CMake builds it. Its presence also makes the wheel platform-specific.
        kwargs["ext_modules"] = [Extension(f"{PACKAGE}._C", sources=[])]
        kwargs["cmdclass"] = _make_cmdclass(plan)
    else:
        kwargs["cmdclass"] = _make_pure_cmdclass()
    return kwargs


def main() -> None:
    import setuptools

    try:
        check_setuptools(setuptools.__version__)
        plan = BuildPlan()
    except BuildConfigError as err:
        _log(f"nsa_cp build error: {err}")
        raise SystemExit(1) from None
    _log(plan.summary())
    setuptools.setup(**setup_kwargs(plan))


if __name__ == "__main__":
    main()
