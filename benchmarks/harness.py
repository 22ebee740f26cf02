"""What every benchmark script shares (nccl-tests' shape: one harness, one small file per measured thing):
spawning ranks, ending a run at its first failure, checking output paths before anything is measured,
seeded inputs, poisoning, the timing protocol, the environment tags of result rows, smoke-run labels,
and the table helpers and CSV / JSON writers.

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
* ``init_rank`` / ``init_nccl_rank`` / ``spawn_ranks``: a rank's device and process group (one GPU per
  rank over NCCL, gloo ranks on the CPU, gloo ranks sharing cuda:0); ``run_ranks``: spawn, then rank 0's
  result file.
* ``Ctx``, ``seed_of``, ``randn``, ``poison``: what a method sees; inputs from seeds every rank knows
  (so any rank can rebuild any rank's inputs); outputs filled with NaN before a check. ``p2p_needs`` /
  ``p2p_prepare`` / ``with_env``: hooks the P2P and NCCL rows of several scripts share.
* ``MoeStandIn`` (``MoeShape``, ``MOE_DEEPSEEK_V3``, ``MOE_SMOKE``): a DeepSeek-V3-shaped MoE stand-in, the
  consumer of overlap.py and overlapped_boundary.py.
* ``time_methods`` (``time_round``, ``aligner``): the timing protocol of docs/performance.md's
  "Method": warm-up, rounds of interleaved methods in a per-round order, CUDA events after
  an untimed aligner, the host enqueuing ahead, median over rounds, MAX over ranks.
* ``run_rank``: the per-rank loop over configurations (layout, context, rows, rank 0's result file);
  ``by_config`` / ``skipped_lines`` / ``config_sections`` / ``header_line`` / ``markdown_row`` /
  ``markdown_head`` / ``cell``: table helpers; ``imbalanced_counts``: the ``--imbalance`` sweep's counts;
  ``write_rows``: CSV / JSON; ``release_memory``: a configuration's caches and CUDA memory handed back
  once it is timed.
* ``arg_parser``: a script's parser (its docstring's first paragraph); ``import_engine``: the serving
  engine a script reads, or a one-line refusal saying what to install.

A benchmark script declares its methods, their expected outputs and its bandwidth rule, and calls these;
a larger one keeps the rest in parts of its own (``<script>_<part>.py``, imported by that script alone).
The layout: docs/performance.md, "Reproducing".

This module is a helper, not a script (it has no ``__main__``): tests/bench/test_benchmarks_smoke.py runs
every benchmark script at a tiny size, and skips this helper and the scripts' parts by that rule.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import fnmatch
import importlib
import json
import math
import multiprocessing
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch 2.13 deprecates the old names; torch 2.11 has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
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


# ============================================================================ command line
def arg_parser(doc: str, **kw) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph as the description, kept as written."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def import_engine(module: str, script: str, pin: str, install: str):
    """``import module`` for a script that reads a serving engine's own code; without it, SystemExit with
    one line naming the version to install and how (no traceback), as the GPU-only scripts refuse."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise SystemExit(f"{script} needs {pin} ({err}): bash {install}") from None


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
    if getattr(device, "type", device) == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine() or platform.processor() or '?'})"


def env_tags(device, backend: str, world: int, nsa=None, mode: Optional[str] = None) -> dict:
    """Where a row was measured: the date, the device and how many ranks on how many devices, the
    process-group backend and the versions (torch, CUDA, NCCL, Triton, flashinfer, nsa_cp, git
    revision), and the NSA_CP_* / multicast settings. Versions and devices only: never a local path."""
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


# ============================================================================ ranks and process groups
MODES = ("nccl", "cpu", "shared-gpu")  # one GPU per rank | gloo ranks on the CPU | gloo ranks sharing cuda:0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, mode: str, port: int) -> torch.device:
    """This rank's device and default process group for ``mode`` (see MODES)."""
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\..*")
    init = f"tcp://127.0.0.1:{port}"
    if mode == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=device)
        return device
    if mode == "shared-gpu":  # the data moves through P2P over CUDA IPC; gloo carries control only
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    return device


def init_nccl_rank(rank: int, world: int, store_path: str) -> None:
    """This process's GPU and its NCCL process group over a FileStore (the two-GPU diagnostics,
    host_overhead.py and p2p_latency.py)."""
    keep_multicast_off()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def spawn_ranks(worker, args, script: str, min_gpus: int) -> None:
    """``worker(rank, world, args)`` on min(2, visible GPUs) ranks; ``args.store`` is set for
    ``init_nccl_rank``. Exits saying why (status 2) when fewer than ``min_gpus`` GPUs are visible."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = min(2, gpus)
    if world < min_gpus:
        raise SystemExit(f"{script} needs {min_gpus} CUDA GPU(s) with NCCL, found {gpus}: nothing to measure here")
    args.store = os.path.join(tempfile.mkdtemp(), "store")
    spawn(worker, world, (args,), what=script)


def run_ranks(worker, world: int, mode: str, args, configs, *extra, prefix: str, what: str,
              timeout_s: Optional[float] = None) -> dict:
    """``worker(rank, world, mode, port, args, configs, result_path, *extra)`` on ``world`` processes
    (``spawn``: the first failing rank ends the run with its traceback; with ``timeout_s``, stopped past
    it). Returns the result rank 0 wrote to ``result_path`` (``run_rank``)."""
    fd, result_path = tempfile.mkstemp(prefix=prefix, suffix=".json")
    os.close(fd)
    try:
        spawn(worker, world, (mode, free_port(), args, configs, result_path, *extra), timeout_s=timeout_s, what=what)
        with open(result_path) as f:
            result = json.load(f)
    finally:
        os.unlink(result_path)
    return result


def import_nsa_cp():
    try:
        import nsa_cp
    except ImportError:
        sys.path.insert(0, REPO_ROOT)
        import nsa_cp
    return nsa_cp


def init_native_nccl(nsa, rank: int, device: torch.device) -> None:
    """``nsa_cp.init_nccl`` on the default group, or a line saying why there is no native communicator."""
    reason = nsa.nccl_unavailable_reason(None)
    if reason:
        print(f"rank {rank}: no native NCCL communicator: {reason}", flush=True)
    else:
        nsa.init_nccl(None, device)


def rank_log(rank: int) -> Callable[[str], None]:
    """A ``log(msg)`` that prints on rank 0 only."""

    def log(msg):
        if rank == 0:
            print(msg, flush=True)  # stdout, so that the table printed last stays last in one stream

    return log


# ============================================================================ context, inputs, poisoning
@dataclasses.dataclass
class Ctx:
    """What every method needs besides its buffers."""

    nsa: object  # the nsa_cp module (imported lazily in the worker)
    layout: object  # nsa_cp.ShardLayout
    group: Optional[dist.ProcessGroup]
    rank: int
    world: int
    device: torch.device
    backend: str  # "nccl" | "gloo"
    hidden: int = 7168
    dtype: torch.dtype = torch.bfloat16

    @property
    def counts(self) -> Tuple[int, ...]:
        return tuple(self.layout.per_rank_actual_token)

    @property
    def M(self) -> int:
        return self.layout.max_rank_len

    @property
    def n(self) -> int:
        return self.counts[self.rank]

    @property
    def shared_gpu(self) -> bool:
        """Ranks sharing one GPU: a gloo group for control, CUDA tensors, P2P over CUDA IPC for data."""
        return self.backend == "gloo" and self.device.type == "cuda"

    @property
    def control(self) -> torch.device:
        """Where the harness's own small collectives (verdicts, statistics) run: gloo's are on the CPU."""
        return torch.device("cpu") if self.backend == "gloo" else self.device

    @property
    def p2p_backend(self) -> str:
        """The backend the P2P rows ask for: "auto" (what a user gets) on one GPU per rank; "p2p" when the
        ranks share a GPU, so a call P2P cannot serve raises instead of timing gloo's host copies."""
        return "p2p" if self.shared_gpu else "auto"


def ctx_tags(ctx: Ctx) -> Dict[str, str]:
    """The tags of this run's rows (env_tags: versions and devices, never a local path)."""
    mode = ("ranks sharing one GPU (gloo + P2P over CUDA IPC): total work, not latency" if ctx.shared_gpu
            else None)
    return env_tags(ctx.device, ctx.backend, ctx.world, ctx.nsa, mode)


def seed_of(*parts: int) -> int:
    s = 0x9E3779B9
    for p in parts:
        s = (s * 1_000_003 + int(p)) % (2**61 - 1)
    return s


def randn(shape, seed, dtype, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype, device=device)


def rotating_sets(device: torch.device, set_bytes: int, most: int) -> int:
    """How many rotating buffer sets of ``set_bytes`` each: about 4x L2 in all (at least 2, at most
    ``most``), so L2 does not serve repeated inputs; 2 on the CPU."""
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
        return max(2, min(most, math.ceil(4 * l2 / max(1, set_bytes))))
    return 2


def release_memory(device: torch.device, *caches: dict) -> None:
    """After a configuration, once its buffer sets are dropped: empty the caches that still hold its
    tensors (communicators, staged buffers) and hand the freed memory back to CUDA for the next one."""
    for cache in caches:
        cache.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(ctx: Ctx):
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def poison(ctx: Ctx, outputs: Iterable[torch.Tensor]):
    """NaN into ``outputs`` and the P2P transport's gather buffers, then every rank waits for all."""
    for t in outputs:
        t.fill_(float("nan"))
    transport = ctx.nsa.transport.get_p2p(ctx.group) if hasattr(ctx.nsa.transport, "get_p2p") else None
    if transport is not None:  # P2P gathers return views of these buffers (private names: best effort)
        for t in getattr(transport, "_gathers", ()):
            t.fill_(float("nan"))
    # every rank's fill is done before any rank starts the next call: a double-buffered P2P gather
    # writes into a peer's buffer without waiting for that peer to enter the call
    sync(ctx)
    dist.barrier(group=ctx.group)


OK, SKIP, BAD = 0, 1, 2  # a method's verdict in the correctness check (MAX over ranks)


def verdicts(ctx: Ctx, names: Sequence[str], status: torch.Tensor, notes: Dict[str, str]) -> Tuple[List[int], Dict[str, str]]:
    """The end of a correctness check, on every rank: each method's verdict (``status``, OK / SKIP / BAD on
    this rank, on ``ctx.control``) as the MAX over ranks. Any BAD aborts the run on every rank: a
    RuntimeError naming the methods and this rank's mismatches (``notes``). Returns (the verdicts,
    {name: skip reason} of the methods skipped on some rank)."""
    flags = status.clone()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=ctx.group)
    flags = flags.tolist()
    bad = [n for n, f in zip(names, flags) if f == BAD]
    if bad:
        mine = [f"  {k}: {v}" for k, v in notes.items() if k in bad]
        msg = f"CORRECTNESS FAILURE, counts {list(ctx.counts)}: {bad}" + (
            f"\n[rank {ctx.rank}]\n" + "\n".join(mine) if mine else f" (no mismatch on rank {ctx.rank})"
        )
        print(msg, file=sys.stderr, flush=True)
        raise RuntimeError(msg)
    return flags, {n: notes.get(n, "NotImplementedError on another rank") for n, f in zip(names, flags) if f == SKIP}


# ============================================================================ hooks several scripts' rows share
def with_env(fn, key: str, value: str):
    """``fn`` called with the environment variable ``key`` set to ``value`` (restored after each call;
    setting and restoring it adds ~1 us of host time per call)."""

    def wrapped(*args):
        saved = os.environ.get(key)
        os.environ[key] = value
        try:
            return fn(*args)
        finally:
            if saved is None:
                del os.environ[key]
            else:
                os.environ[key] = saved

    return wrapped


def interleaved_medians_us(rows: Dict[str, Callable[[], object]], calls: int,
                           sync: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """Host microseconds per call of each of ``rows`` (perf_counter), the median of ``calls`` rounds that
    call every row once in turn, so a drift of the machine reaches every row alike; ``sync`` (the GPU's)
    runs every 5 rounds and at the end, outside the timed calls."""
    samples = {name: [] for name in rows}
    for i in range(calls):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e6)
        if sync is not None and i % 5 == 4:
            sync()
    if sync is not None:
        sync()
    return {name: statistics.median(s) for name, s in samples.items()}


def python_calls(fn, calls: int = 5) -> float:
    """Python function calls per call of ``fn`` (``sys.setprofile`` "call" and "c_call" events, mean of
    ``calls``): a count, so two library trees compare on it without the noise of the host."""
    seen = [0]

    def count(frame, event, arg):
        if event == "call" or event == "c_call":
            seen[0] += 1

    sys.setprofile(count)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.setprofile(None)
    return seen[0] / calls


def match_names(patterns: str, names: Sequence[str]) -> set:
    """The names matching any of ``--methods``' comma-separated names or globs; SystemExit listing the
    choices when none does."""
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in pats)}
    if not chosen:
        raise SystemExit(f"--methods {patterns!r} matches none of {list(names)}")
    return chosen


def runnable(ctx: Ctx, methods: Sequence, refuse: Optional[Callable] = None) -> Tuple[list, Dict[str, str]]:
    """The methods that can run in this configuration, and {name: why not} of the others (``m.needs(ctx)``,
    then ``refuse(ctx, m)``, each a reason or None); then each distinct ``prepare`` hook of the runnable
    ones once, in order (a collective: every rank calls it)."""
    active, skipped = [], {}
    for m in methods:
        reason = (m.needs(ctx) if m.needs else None) or (refuse(ctx, m) if refuse else None)
        if reason:
            skipped[m.name] = reason
        else:
            active.append(m)
    for prepare in dict.fromkeys(m.prepare for m in active if m.prepare):
        prepare(ctx)
    return active, skipped


def p2p_prepare(c: Ctx):
    """(Re)create the group's P2P transport when this configuration outgrows it (collective)."""
    t = c.nsa.transport.get_p2p(c.group)
    hidden, dtype = c.hidden, c.dtype
    if t is None or t.max_tokens_per_rank < c.M or t.hidden_size != hidden or t.dtype != dtype:
        c.nsa.init_p2p(c.group, max(c.M, 1), hidden, dtype, c.device)


def p2p_needs(c: Ctx) -> Optional[str]:
    if c.device.type != "cuda":
        return "P2P needs CUDA GPUs"
    try:
        from nsa_cp.rows import _native

        if not _native.available():
            return f"nsa_cp._C unavailable: {_native.unavailable_reason()}"
    except (ImportError, AttributeError):  # the native module's API moved: init_p2p decides (and says why)
        pass
    return None


# ============================================================================ a MoE stand-in (overlap.py, overlapped_boundary.py)
@dataclasses.dataclass(frozen=True)
class MoeShape:
    hidden: int = 7168
    inter: int = 2048
    routed: int = 256
    topk: int = 8


MOE_DEEPSEEK_V3 = MoeShape()
MOE_SMOKE = MoeShape(hidden=256, inter=64, routed=16, topk=4)  # CPU smoke runs: the same calls, tiny


class MoeStandIn:
    """A DeepSeek-V3-shaped MoE stand-in of one rank of ``cp`` (its weights random, scaled to keep
    activations O(1)); overlap.py runs it per chunk of one emulated rank, overlapped_boundary.py on every
    rank. DeepSeek-V3's config.json: hidden_size 7168, moe_intermediate_size 2048, n_routed_experts 256,
    num_experts_per_tok 8, n_shared_experts 1. Per chunk ``x [rows, H]`` -> partials ``out [rows, H]``:

    * the shared expert, whole: gate_up ``[rows, 7168] x [7168, 2*2048]``, SiLU(gate) * up, down
      ``[rows, 2048] x [2048, 7168]`` written into ``out``;
    * the routed experts this rank holds, EP-split over the cp ranks (256 / cp experts), with balanced
      routing: each local expert gets ``ceil(rows * 8 / 256)`` of the chunk's rows (a fixed random choice
      per chunk size, so not a per-row function), so the rank does ``rows * 8 / cp`` expert passes. The
      grouped GEMM is two ``torch.bmm`` over the experts (gate_up, then down after SiLU * up), between the
      permutation (``index_select``) and the weighted combine into ``out`` (``index_add_``). Every call
      reads all the rank's expert weights, as a grouped GEMM does.

    FLOPs per chunk: (rows + experts * rows_per_expert) * 6 * H * I. The routing is fixed, not learned: the
    stand-in has a MoE's shapes, FLOPs and bytes, not its values."""

    def __init__(self, shape: MoeShape, cp: int, device: torch.device, dtype=torch.bfloat16, seed: int = 0):
        if shape.routed % cp:
            raise SystemExit(f"{shape.routed} routed experts do not split over cp = {cp} ranks")
        self.shape, self.cp, self.device, self.dtype = shape, cp, device, dtype
        self.experts = shape.routed // cp
        H, I = shape.hidden, shape.inter
        g = torch.Generator(device=device).manual_seed(seed)

        def weight(*size, fan_in):
            w = torch.randn(size, generator=g, device=device, dtype=dtype)
            return w.mul_(1.0 / math.sqrt(fan_in))

        self.w_gate_up = weight(H, 2 * I, fan_in=H)
        self.w_down = weight(I, H, fan_in=I)
        self.w1 = weight(self.experts, H, 2 * I, fan_in=H)
        self.w2 = weight(self.experts, I, H, fan_in=I)
        self._routes: Dict[int, Tuple[torch.Tensor, torch.Tensor, int]] = {}

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.w_gate_up, self.w_down, self.w1, self.w2))

    def rows_per_expert(self, rows: int) -> int:
        return math.ceil(rows * self.shape.topk / self.shape.routed)

    def flops(self, rows: int) -> float:
        expert_rows = self.experts * self.rows_per_expert(rows) if rows else 0
        return (rows + expert_rows) * 6.0 * self.shape.hidden * self.shape.inter

    def route(self, rows: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """(row index of every expert slot, its combine weight, rows per expert) for a chunk of ``rows``."""
        if rows not in self._routes:
            rpe = self.rows_per_expert(rows)
            slots = self.experts * rpe
            g = torch.Generator().manual_seed(rows)
            perms = [torch.randperm(rows, generator=g) for _ in range(math.ceil(slots / rows))]
            idx = torch.cat(perms)[:slots].to(self.device)
            wts = torch.rand(slots, 1, generator=g).to(self.device, self.dtype)
            self._routes[rows] = (idx, wts, rpe)
        return self._routes[rows]

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out [rows, H]`` = the shared expert of ``x [rows, H]`` + its routed experts' weighted sum."""
        rows = x.shape[0]
        if rows == 0:
            return
        I = self.shape.inter
        gu = torch.mm(x, self.w_gate_up)
        torch.mm(torch.nn.functional.silu(gu[:, :I]) * gu[:, I:], self.w_down, out=out)
        idx, wts, rpe = self.route(rows)
        xp = x.index_select(0, idx).view(self.experts, rpe, -1)
        g = torch.bmm(xp, self.w1)
        y = torch.bmm(torch.nn.functional.silu(g[..., :I]) * g[..., I:], self.w2).view(self.experts * rpe, -1)
        out.index_add_(0, idx, y.mul_(wts))


# ============================================================================ timing
AHEAD_CYCLES_PER_METHOD = 2_000_000  # ~1 ms of GPU sleep per method: covers any method's host time


def aligner(ctx: Ctx):
    """What runs, untimed, before each method's start event, so that every method starts with the ranks
    released together. Without it a method inherits the skew its predecessor in the round leaves
    (the ranks leave NCCL's grouped calls several microseconds apart, a P2P kernel within one signal
    latency), and its time depends on its neighbour: 3 us of 24 at M = 256 on 2x H200. With a P2P
    transport: its one-block barrier (ranks within one signal latency); else a one-element NCCL
    all-reduce; nothing on CPU (host timing)."""
    if ctx.device.type != "cuda":
        return None
    transport = ctx.nsa.transport.get_p2p(ctx.group) if hasattr(ctx.nsa.transport, "get_p2p") else None
    if transport is not None and callable(getattr(transport, "barrier", None)):
        return transport.barrier
    if ctx.shared_gpu:  # no device collective between ranks sharing a GPU without a transport
        return None
    flag = torch.zeros(1, dtype=torch.int32, device=ctx.device)
    return lambda: dist.all_reduce(flag, group=ctx.group)


def time_round(
    ctx: Ctx, methods, bufsets, order, call0, ahead: bool = True, align=None
) -> Dict[str, Tuple[float, float]]:
    """One round: barrier, then each method once in ``order``, each after ``align`` (``aligner``'s).

    Returns {name: (device ms, host ms)} on this rank: device time between CUDA events around the call
    (on CPU the host time), and the host time the call took to return (to enqueue, on GPU).
    With ``ahead`` the GPU first sleeps long enough for the host to enqueue the whole round, so the
    events measure device time alone (as in a model whose CPU runs ahead, or a CUDA graph); without
    it, a method whose host time exceeds its device time is timed at its host time."""
    nb = len(bufsets)
    cuda = ctx.device.type == "cuda"
    dist.barrier(group=ctx.group)
    if cuda and ahead:
        torch.cuda._sleep(AHEAD_CYCLES_PER_METHOD * len(order))
    events, host = [], {}
    for k, i in enumerate(order):
        s = e = None
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if align is not None:
                align()
            s.record()
        t0 = time.perf_counter()
        methods[i].fn(ctx, bufsets[(call0 + k) % nb])
        host[methods[i].name] = (time.perf_counter() - t0) * 1e3
        if cuda:
            e.record()
        events.append((methods[i].name, s, e))
    if not cuda:
        return {name: (h, h) for name, h in host.items()}
    torch.cuda.synchronize(ctx.device)
    return {name: (s.elapsed_time(e), host[name]) for name, s, e in events}


def time_methods(ctx: Ctx, methods, bufsets, rounds, warmup, ahead: bool = True) -> Dict[str, Dict[str, float]]:
    nm, nb = len(methods), len(bufsets)
    for w in range(warmup):
        for i, m in enumerate(methods):
            m.fn(ctx, bufsets[(w * nm + i) % nb])
    sync(ctx)
    samples: Dict[str, List[float]] = {m.name: [] for m in methods}
    host: Dict[str, List[float]] = {m.name: [] for m in methods}
    align = aligner(ctx)
    for r in range(rounds):
        order = random.Random(r).sample(range(nm), nm)  # every rank draws the same order
        for name, (t, h) in time_round(ctx, methods, bufsets, order, r * nm, ahead, align).items():
            samples[name].append(t)
            host[name].append(h)
    # per rank: median, min, IQR/median over rounds, median host time; then MAX over ranks
    local = []
    for m in methods:
        ts = sorted(samples[m.name])
        med = statistics.median(ts)
        q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
        local.append([med, ts[0], (q[2] - q[0]) / med if med > 0 else 0.0, statistics.median(host[m.name])])
    stats = torch.tensor(local, dtype=torch.float64, device=ctx.control)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=ctx.group)
    keys = ("ms", "min_ms", "spread", "host_ms")
    return {m.name: dict(zip(keys, row)) for m, row in zip(methods, stats.tolist())}



# ============================================================================ the per-rank loop
def run_rank(rank: int, device: torch.device, nsa, configs, args, make_ctx: Callable, run_config: Callable,
             result: dict, result_path: str, row_tags: Optional[dict] = None) -> None:
    """Every configuration (a list of per-rank counts) in turn: its ``nsa_cp.ShardLayout``
    (``args.align``), ``ctx = make_ctx(layout)``, ``rows, skipped = run_config(ctx, index)``; the rows
    (each updated with ``row_tags``) and skip reasons go into ``result``, whose ``tags`` are the first
    context's. Rank 0 writes ``result`` to ``result_path`` as JSON; then the group is torn down."""
    # no try/finally around this: a rank that raises exits at once (spawn) and the parent stops the
    # others; tearing the group down here could wait on a peer stuck in a collective
    for i, counts in enumerate(configs):
        layout = nsa.ShardLayout(per_rank_actual_token=list(counts), align=args.align)
        ctx = make_ctx(layout)
        if result["tags"] is None:
            result["tags"] = ctx_tags(ctx)
        rows, skipped = run_config(ctx, i)
        for r in rows:
            r.update(row_tags or {})
        result["rows"] += rows
        result["skipped"][str(i)] = skipped
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(result, f)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ reports
def header_line(tags: dict) -> str:
    """One line naming the run: device x ranks, versions, revision, date."""
    return (f"{tags['gpu']} x{tags['world']} ({tags.get('mode', '')}) | torch {tags['torch']} | NCCL {tags['nccl']}"
            f" | triton {tags['triton']} | nsa_cp {tags['nsa_cp']} (git {tags['git_rev']}) | {tags['date']}")


def by_config(result: dict) -> List[Tuple[int, List[dict]]]:
    """``(config, its rows)`` in config order, with the configurations that have only skip reasons."""
    by_cfg: Dict[int, List[dict]] = {}
    for r in result["rows"]:
        by_cfg.setdefault(r["config"], []).append(r)
    cfgs = sorted(set(by_cfg) | {int(k) for k, v in result["skipped"].items() if v})
    return [(cfg, by_cfg.get(cfg, [])) for cfg in cfgs]


def skipped_lines(result: dict, cfg: int, width: int) -> List[str]:
    return [f"{name:<{width}}skipped: {why}" for name, why in result["skipped"].get(str(cfg), {}).items()]


def config_sections(result: dict, head: Callable[[dict], List[str]], line: Callable[[dict], str],
                    width: int) -> List[str]:
    """A table's body, one section per configuration (``by_config``): a blank line, ``head(first row)``
    (where it has rows), ``line(row)`` per row, then its skipped methods (``skipped_lines`` at ``width``)."""
    lines: List[str] = []
    for cfg, rs in by_config(result):
        lines.append("")
        if rs:
            lines += head(rs[0])
        lines += [line(r) for r in rs]
        lines += skipped_lines(result, cfg, width)
    return lines


def imbalanced_counts(Ms: Sequence[int], world: int, imbalance: float) -> List[Tuple[int, ...]]:
    """One configuration per M: the real counts ``[M, round(M * (1 - imbalance)), M, ...]`` over ``world``
    ranks (``--imbalance``)."""
    return [tuple((M, int(round(M * (1 - imbalance))))[r % 2] for r in range(world)) for M in Ms]


def cell(v: Optional[float], fmt: str) -> str:
    """A table cell: ``v`` in ``fmt``, or "n/a" for None or NaN."""
    return "n/a" if v is None or math.isnan(v) else format(v, fmt)


def markdown_row(cells: Sequence[object]) -> str:
    """One row of a Markdown table: ``| a | b |``."""
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown_head(columns: Sequence[str]) -> str:
    """A Markdown table's header row and the rule under it."""
    return markdown_row(columns) + "\n|" + "---|" * len(columns)


def write_rows(tags: Optional[dict], rows: List[dict], csv_path: Optional[str], json_path: Optional[str],
               **extra) -> None:
    """One row per result row, each prefixed with ``tags``: CSV, and JSON ``{"rows": ..., **extra}``;
    then a ``wrote PATH`` line per file. Call it after the tables are printed (a file that cannot be
    written loses no printed result)."""
    full = [{**(tags or {}), **r} for r in rows]
    if csv_path and full:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(full[0].keys()))
            w.writeheader()
            w.writerows(full)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"rows": full, **extra}, f, indent=1)
    for path in (csv_path, json_path):
        if path:
            print(f"wrote {path}", flush=True)


def part_of(script: Optional[str], name: str) -> None:
    """Called at the top of a script's part with the part's ``__name__`` (and at the end of this module):
    run directly, a part says which script it belongs to and exits with status 2 instead of doing
    nothing. The parts carry no ``__main__`` guard, so the smoke test does not take them for scripts."""
    if name == "__main__":
        what = f"a part of benchmarks/{script}" if script else "the harness every benchmark script shares"
        run = script or "gather_scatter.py"
        print(f"{sys.argv[0]}: {what}, not a script: run python benchmarks/{run} --help", file=sys.stderr)
        sys.exit(2)


part_of(None, __name__)
