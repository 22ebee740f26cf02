"""Plumbing every benchmark script shares: spawning ranks, ending a run at its first failure, checking
output paths before anything is measured, the environment tags of result rows, and smoke-run labels.

* ``spawn(worker, world, args)`` runs ``worker(rank, world, *args)`` in ``world`` fresh processes
  ("spawn" start method) and watches them: the first rank that fails ends the whole run at once (the
  other ranks are terminated, then killed) with a ``RankFailed`` that carries that rank's traceback.
  No rank's failure leaves the others waiting in a collective for minutes. ``timeout_s`` bounds the
  whole run the same way.
* ``check_output_paths(("--csv", path), ...)``: each output's directory must exist and be writable,
  checked before the run, so a typo costs seconds, not a run's device time.
* ``env_tags(...)``: what a result row carries about where it was measured: versions and devices
  (never a local path).
* ``smoke_note(...)``: CPU runs are smoke runs of the harness; they print that instead of verdicts.

This module is a helper, not a script (it has no ``__main__``): tests/test_benchmarks_smoke.py runs
every benchmark script at a tiny size, and skips the helpers by that rule.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Iterable, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = "CPU smoke run: it checks the harness and the library's CPU path; its numbers say nothing about GPUs"


class RankFailed(RuntimeError):
    """A spawned rank failed (or the run timed out); the message has the rank's traceback."""


# ============================================================================ spawning
def _entry(worker: Callable, rank: int, world: int, args: tuple, error_path: str) -> None:
    """A rank's process: run the worker; on any exception write its traceback where the parent reads it
    and exit at once with status 1 (no teardown that could wait on a peer that is already gone)."""
    try:
        worker(rank, world, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent, never swallowed
        when, text = time.time(), traceback.format_exc()
        try:
            with open(error_path, "w") as f:
                f.write(f"{when!r}\n{text}")
        finally:
            sys.stderr.write(f"[rank {rank}] {text}")
            sys.stderr.flush()
            os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: the process-group and CUDA destructors have nothing left to do here,
    # and a crash among them would turn a finished run into a failed one
    os._exit(0)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def spawn(worker: Callable, world: int, args: Sequence = (), *, timeout_s: Optional[float] = None,
          what: str = "benchmark", poll_s: float = 0.05) -> None:
    """Run ``worker(rank, world, *args)`` on ranks ``0 .. world-1``, each in a process of its own, and
    return when every rank has exited cleanly.

    The first rank to exit with a non-zero status (an exception, a signal) ends the run: the other
    ranks are terminated and ``RankFailed`` is raised with that rank's traceback. Past ``timeout_s``
    (None: no limit) every rank is terminated and ``RankFailed`` says which were still running.
    ``worker`` must be importable by the children (a module-level function).
    """
    ctx = multiprocessing.get_context("spawn")
    error_dir = tempfile.mkdtemp(prefix="nsa_cp_bench_")
    paths = [os.path.join(error_dir, f"rank{r}.err") for r in range(world)]
    procs = [ctx.Process(target=_entry, args=(worker, r, world, tuple(args), paths[r]), name=f"{what} rank {r}")
             for r in range(world)]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while True:
            codes = [p.exitcode for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # a peer of the failing rank often fails a moment later in a collective ("connection reset"):
                # give them a second, then report the rank that failed FIRST, the cause
                grace = time.monotonic() + 1.0
                while time.monotonic() < grace and any(p.exitcode is None for p in procs):
                    time.sleep(poll_s)
                codes = [p.exitcode for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                _stop(procs)
                errors = {r: _read(paths[r]) for r in failed}
                r = min(failed, key=lambda q: errors[q][0])
                others = [q for q in failed if q != r]
                also = (f" (then rank(s) {others} failed too: {', '.join(_last_line(errors[q][1]) for q in others)})"
                        if others else "")
                raise RankFailed(f"{what}: rank {r} of {world} failed first ({_describe(codes[r])}); the other "
                                 f"ranks were stopped{also}.\n{errors[r][1]}")
            if all(c == 0 for c in codes):
                return
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                _stop(procs)
                raise RankFailed(f"{what}: still running after {timeout_s:.0f} s (ranks {running}): stopped")
            time.sleep(poll_s)
    finally:
        _stop(procs)
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
        os.rmdir(error_dir)


def _describe(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def _read(path: str) -> Tuple[float, str]:
    """(when the rank failed, its traceback) from its error file."""
    try:
        with open(path) as f:
            when, _, text = f.read().partition("\n")
        return float(when), text.rstrip()
    except (OSError, ValueError):
        return float("inf"), "(no traceback: the process ended without raising a Python exception, e.g. a signal)"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "?"


def run_main(main: Callable[[], None]) -> None:
    """``main()``, with a failed rank turned into exit status 1 and its traceback on stderr."""
    try:
        main()
    except RankFailed as e:
        sys.stderr.write(f"{e}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None


# ============================================================================ output paths
def check_output_paths(outputs: Iterable[Tuple[str, Optional[str]]]) -> None:
    """``(flag, path)`` pairs; each given path's directory must exist and be writable, and the path must
    not be a directory. Raises SystemExit naming the flag and the path, before anything is measured."""
    for flag, path in outputs:
        if not path:
            continue
        where = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise SystemExit(f"{flag} {path}: is a directory; give a file name (nothing was measured)")
        if not os.path.isdir(where):
            raise SystemExit(f"{flag} {path}: the directory {where} does not exist (nothing was measured)")
        if not os.access(where, os.W_OK):
            raise SystemExit(f"{flag} {path}: the directory {where} is not writable (nothing was measured)")


# ============================================================================ tags and labels
def _version(module: str) -> str:
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "?"))
    except Exception:  # noqa: BLE001 - optional packages
        return "n/a"


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        rev = ""
    return rev or "n/a"


def device_name(device) -> str:
    """'NVIDIA H200' for a CUDA device; 'CPU (x86_64)' otherwise."""
    import torch

    if getattr(device, "type", device) == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine() or platform.processor() or '?'})"


def env_tags(device, backend: str, world: int, nsa=None, mode: Optional[str] = None) -> dict:
    """Where a row was measured: the date, the device and how many ranks on how many devices, the
    process-group backend and the versions (torch, CUDA, NCCL, Triton, flashinfer, nsa_cp, git
    revision), and the NSA_CP_* / multicast settings. Versions and devices only: never a local path."""
    import torch

    cuda = getattr(device, "type", device) == "cuda"
    nccl = "n/a"
    if cuda:
        v = torch.cuda.nccl.version()  # a tuple (2, 28, 9) in recent torch, an int in old ones
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": device_name(device),
        "backend": backend,
        "world": str(world),
        "devices": str(torch.cuda.device_count()) if cuda else "0",
        "mode": mode or ("one process per GPU" if cuda else "cpu smoke run"),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nccl": nccl,
        "triton": _version("triton"),
        "flashinfer": _version("flashinfer") if cuda else "n/a",
        "nsa_cp": str(getattr(nsa, "__version__", "?")) if nsa is not None else _version("nsa_cp"),
        "git_rev": git_rev(),
        "python": platform.python_version(),
        "nsa_cp_env": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NSA_CP_")),
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", ""),
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", ""),
    }


def is_smoke(tags: Optional[dict]) -> bool:
    """Whether result rows (their tags) come from a CPU run."""
    return bool(tags) and (tags.get("backend") == "gloo" and tags.get("devices", "0") == "0"
                           or str(tags.get("gpu", "")).startswith("CPU"))


def smoke_note(tags: Optional[dict]) -> Optional[str]:
    """The line a CPU run prints instead of verdicts (None for a GPU run)."""
    return f"*** {SMOKE}; no targets are checked ***" if is_smoke(tags) else None


def keep_multicast_off() -> None:
    """NVLink multicast is off on the target machines: nothing may depend on it (set when unset)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
