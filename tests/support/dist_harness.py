"""Spawn a process group once per world size and run many checks inside it.

``run_world(world_size, backend, fn, payload)`` starts ``world_size`` spawned processes, initialises
torch.distributed over a FileStore, calls ``fn(rank, world_size, payload)`` in each (it returns a
``{case_id: None | error text}`` dict) and returns the per-rank dicts. A rank that dies or hangs past
``timeout_s`` fails the whole world with its traceback, never a hang.

Backends: "gloo" (CPU tensors), "nccl" (rank r on cuda:r) and "gloo-shared-gpu": a gloo group whose
ranks all use cuda:0, for checks of the P2P transport across processes on a machine with one GPU (symmetric
memory maps the peers' buffers through CUDA IPC; the GPU time-slices the ranks' kernels). Cases ask
``rank_device(rank)`` for their device and ``shared_gpu()`` whether NCCL is out of reach.

``run_spawned(target, *args)`` runs one function in a fresh ``spawn``-ed process (as SGLang starts a
scheduler and vLLM a worker) and returns the dict it queues.

``WorldPool(world_size, backend, handler)`` keeps one such world alive and serves many small requests
(``pool.run(payload)``), for tests that make hundreds of calls (the property tests).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List

Results = Dict[str, Any]
_DEAD_GRACE_S = 10.0  # a rank's queued result may trail its exit; after this long it is not coming


def rank_log(message: str) -> None:
    """Progress line into $NSA_TEST_LOG_DIR/rank<R>.log when that is set (GPU runs keep these)."""
    stream = _LOG.get("file")
    if stream is not None:
        stream.write(f"{datetime.datetime.now().strftime('%H:%M:%S.%f')[:-3]} {message}\n")
        stream.flush()


_LOG = {}
_WORLD = {"shared_gpu": False}


def shared_gpu() -> bool:
    """Whether this rank's world shares one GPU (backend "gloo-shared-gpu": no NCCL between the ranks)."""
    return _WORLD["shared_gpu"]


def rank_device(rank: int):
    """This rank's CUDA device: cuda:rank, or cuda:0 when the world shares one GPU."""
    import torch

    return torch.device("cuda", 0 if _WORLD["shared_gpu"] else rank)


def _open_rank_log(name: str) -> None:
    """Progress log (and stack dumps of a stalled rank) under $NSA_TEST_LOG_DIR, when that is set."""
    log_dir = os.environ.get("NSA_TEST_LOG_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        _LOG["file"] = open(os.path.join(log_dir, name), "a")
        # a rank that stops making progress dumps every thread's stack, then keeps waiting
        faulthandler.dump_traceback_later(int(os.environ.get("NSA_TEST_STACK_DUMP_S", "120")), repeat=True, file=_LOG["file"])


def _init_group(rank: int, world_size: int, backend: str, store_path: str, pg_timeout_s: float) -> None:
    """This process's device and process group (multicast kept off, a timeout on every collective)."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if backend == "gloo-shared-gpu":
        _WORLD["shared_gpu"] = True
        backend = "gloo"
        torch.cuda.set_device(0)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world_size)
    kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    # a collective that never completes (a rank left the sequence) fails after this, not never
    kwargs["timeout"] = datetime.timedelta(seconds=pg_timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)


def _entry(rank, world_size, backend, store_path, fn, payload, results):
    _open_rank_log(f"rank{rank}.log")
    rank_log(f"rank {rank}/{world_size} {backend} start: {getattr(fn, '__name__', fn)}")
    try:
        import torch.distributed as dist

        _init_group(rank, world_size, backend, store_path, int(os.environ.get("NSA_TEST_PG_TIMEOUT_S", "300")))
        try:
            results.put((rank, fn(rank, world_size, payload)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, never swallow: the parent turns this into a failure
        rank_log(traceback.format_exc())
        results.put((rank, {"__world__": traceback.format_exc()}))
    finally:
        faulthandler.cancel_dump_traceback_later()
        rank_log("exit")


def run_world(
    world_size: int, backend: str, fn: Callable, payload: Any, timeout_s: float = 600.0, may_exit=()
) -> List[Results]:
    """Run ``fn`` on every rank; ``timeout_s`` is the longest wait for the next rank's result. A rank in
    ``may_exit`` may leave without a result (a test of a dying peer): its result is then
    ``{"__exited__": exit code}``. Any other rank that exits without a result (a crash) fails the world
    ``_DEAD_GRACE_S`` after its exit, not at ``timeout_s``: its peers may be blocked on it forever."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(rank, world_size, backend, store_path, fn, payload, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        per_rank: Dict[int, Results] = {}
        try:
            deadline = time.monotonic() + timeout_s
            dead_since: Dict[int, float] = {}
            crashed = None  # once a rank crashed: the latest the others may still answer
            while len(per_rank) < world_size:
                try:
                    rank, result = results.get(timeout=1.0)
                except queue.Empty:
                    now = time.monotonic()
                    for rank, proc in enumerate(procs):
                        if rank in per_rank or proc.exitcode is None:
                            continue
                        if rank in may_exit:
                            per_rank[rank] = {"__exited__": proc.exitcode}
                        elif now - dead_since.setdefault(rank, now) > _DEAD_GRACE_S:  # its result never came
                            per_rank[rank] = {"__world__": f"rank {rank} exited (code {proc.exitcode}) without "
                                                           f"sending its result: a crash (see its log)"}
                            # its peers may wait on it in a collective: they get a short while, not timeout_s
                            crashed = deadline = min(deadline, now + 3 * _DEAD_GRACE_S)
                    if len(per_rank) == world_size:
                        break
                    if now < deadline:
                        continue
                    raise
                per_rank[rank] = result
                deadline = time.monotonic() + timeout_s if crashed is None else crashed
        except queue.Empty:
            missing = sorted(set(range(world_size)) - set(per_rank))
            why = "after a peer crashed" if crashed is not None else f"within {timeout_s:.0f} s"
            for rank in missing:
                per_rank[rank] = {"__world__": f"rank {rank} sent no result {why}"}
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    return [per_rank[r] for r in range(world_size)]


def run_cases(cases, check: Callable, after: Callable = lambda: None) -> Results:
    """``{key: None | traceback}``: ``check(*args)`` for each ``key, args`` of ``cases`` (a dict or pairs), a
    failure recorded, never raised (a rank keeps the world in step), ``after()`` following every case."""
    results = {}
    for key, args in (cases.items() if isinstance(cases, dict) else cases):
        try:
            check(*args)
            results[key] = None
        except Exception:  # noqa: BLE001  reported through case_failures
            results[key] = traceback.format_exc()
        after()
    return results


def case_failures(per_rank: List[Results], case_id: str) -> List[str]:
    """Error texts for one case across ranks (world-level failures count for every case)."""
    errors = []
    for rank, result in enumerate(per_rank):
        if "__world__" in result:
            errors.append(f"rank {rank}: world failed:\n{result['__world__']}")
        elif case_id not in result:
            errors.append(f"rank {rank}: case {case_id} did not run")
        elif result[case_id] is not None:
            errors.append(f"rank {rank}: {result[case_id]}")
    return errors


# --------------------------------------------------------------------------- persistent worker pool
class WorldPoolError(RuntimeError):
    """A request to a WorldPool failed: a rank died, did not answer in time, or its handler raised."""


def _pool_entry(rank, world_size, backend, store_path, handler, requests, results, pg_timeout_s):
    """One rank of a WorldPool: initialise the group once, then serve ``(seq, payload)`` until None."""
    _open_rank_log(f"pool{world_size}-rank{rank}.log")
    initialised = False
    try:
        import torch.distributed as dist

        _init_group(rank, world_size, backend, store_path, pg_timeout_s)
        initialised = True
        rank_log(f"pool rank {rank}/{world_size} {backend} ready: {getattr(handler, '__name__', handler)}")
        results.put(("ready", rank, None))
        while True:
            item = requests.get()
            if item is None:
                break
            seq, payload = item
            rank_log(f"request {seq}")
            try:
                answer = ("answer", handler(rank, world_size, payload))
            except BaseException:  # the handler should catch its own errors; this one is a harness failure
                answer = ("raised", traceback.format_exc())
            results.put((seq, rank, answer))
    except BaseException:
        rank_log(traceback.format_exc())
        results.put(("died", rank, traceback.format_exc()))
    finally:
        if initialised:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        faulthandler.cancel_dump_traceback_later()
        rank_log("pool exit")


class WorldPool:
    """``world_size`` ranks spawned ONCE (spawn context, FileStore), serving many requests.

    ``pool.run(payload)`` sends the same payload to every rank through that rank's queue, each rank calls
    ``handler(rank, world_size, payload)`` (a picklable module-level function), and the per-rank return
    values come back as a list ordered by rank. A rank that dies, or does not answer within ``timeout_s``,
    or whose handler raises fails the request with a ``WorldPoolError`` naming the rank, the request and
    the payload, and marks the pool broken (its ranks may be stuck in a collective, so they are killed):
    every later ``run`` raises at once, repeating the first failure, instead of hanging. All of these are
    raised from one place, so that Hypothesis sees one failure, not a flaky one, when it replays examples
    on a broken pool (the example it then reports need not be the culprit: the message names that one).
    ``close()`` (also on ``with`` exit) shuts the ranks down; it is idempotent.
    """

    def __init__(self, world_size: int, backend: str, handler: Callable, timeout_s: float = 60.0,
                 start_timeout_s: float = 180.0, pg_timeout_s: float = None):
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.broken = None  # the first failure's message once broken
        self.requests_served = 0
        self._seq = 0
        self._closed = False
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory()
        store_path = os.path.join(self._tmp.name, "store")
        self._requests = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        pg_timeout = int(pg_timeout_s if pg_timeout_s is not None else timeout_s + 30)
        self._procs = [
            ctx.Process(
                target=_pool_entry,
                args=(rank, world_size, backend, store_path, handler, self._requests[rank], self._results, pg_timeout),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        failure = self._collect("ready", start_timeout_s, "starting the world")[1]
        if failure is not None:
            self.close()
            raise WorldPoolError(failure)

    # ------------------------------------------------------------------ internals
    def _collect(self, seq, timeout_s: float, what: str):
        """``(answers by rank, None)``, or ``(None, failure message)``."""
        answers: Dict[int, Any] = {}
        name = f"WorldPool({self.world_size}, {self.backend})"
        deadline = time.monotonic() + timeout_s
        while len(answers) < self.world_size:
            try:
                tag, rank, body = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if r not in answers and not p.is_alive()]
                if dead:
                    ranks = ", ".join(f"rank {r} (exit code {code})" for r, code in dead)
                    return None, f"{name}: {ranks} died while {what}; ranks {sorted(answers)} had answered"
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(answers))
                    return None, (f"{name}: rank(s) {missing} did not answer within {timeout_s:.0f} s while {what} "
                                  f"(ranks {sorted(answers)} had answered; a rank stuck in a collective?)")
                continue
            if tag == "died":
                return None, f"{name}: rank {rank} failed while {what}:\n{body}"
            if tag != seq:
                continue  # a stale message cannot arrive (a failed request breaks the pool); ignore defensively
            answers[rank] = body
        return [answers[r] for r in range(self.world_size)], None

    def _serve(self, payload: Any, timeout_s: float):
        self._seq += 1
        seq = self._seq
        for requests in self._requests:
            requests.put((seq, payload))
        what = f"serving request #{seq} (payload {payload!r})"
        answers, failure = self._collect(seq, timeout_s, what)
        if failure is not None:
            return None, failure
        raised = [(r, body) for r, (kind, body) in enumerate(answers) if kind == "raised"]
        if raised:
            text = "\n".join(f"rank {r}:\n{body}" for r, body in raised)
            return None, f"WorldPool({self.world_size}, {self.backend}): the handler raised while {what}:\n{text}"
        self.requests_served += 1
        return [body for _, body in answers], None

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)

    # ------------------------------------------------------------------ public
    def run(self, payload: Any, timeout_s: float = None) -> List[Any]:
        """Run ``handler(rank, world_size, payload)`` on every rank; the per-rank results, by rank."""
        if self._closed:
            message = "WorldPool: run() after close()"
        elif self.broken is not None:
            message = f"this WorldPool broke on an earlier request and was not run again; the first failure:\n{self.broken}"
        else:
            results, failure = self._serve(payload, self.timeout_s if timeout_s is None else timeout_s)
            if failure is None:
                return results
            self.broken = message = failure
            self._kill()  # its ranks may sit in a collective forever
        raise WorldPoolError(message)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc, requests in zip(self._procs, self._requests):
            if proc.is_alive():
                try:
                    requests.put(None)
                except Exception:
                    pass
        for proc in self._procs:
            proc.join(timeout=20)
        self._kill()
        for q in (*self._requests, self._results):
            q.close()
            q.cancel_join_thread()
        self._tmp.cleanup()

    def __enter__(self) -> "WorldPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- what the case modules share
@contextlib.contextmanager
def scoped_env(values: Dict[str, str], *, keep_set: bool = False):
    """Environment variables set for the ``with`` block (inherited by ranks spawned inside it), then
    restored, each to its old value or unset. ``keep_set``: a variable already set keeps its value."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if not (keep_set and k in os.environ):
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_each(cases, run_one: Callable[[dict], Any]) -> Results:
    """On one rank: ``run_one(case)`` for every case in turn, recording None (it returned None) or its
    text / traceback per case id. A barrier follows each case, so a failing rank never leaves the others
    waiting in a collective of the next one."""
    import torch.distributed as dist

    results: Results = {}
    for case in cases:
        try:
            results[case["id"]] = run_one(case)
        except Exception:
            results[case["id"]] = traceback.format_exc()
        dist.barrier()
    return results


def world_case_test(params, results: Callable[[int], List[Results]], before: Callable[[], None] = lambda: None):
    """A test with one item per ``(world, case id)`` of ``params`` (pairs or ``pytest.param``s of them; assign
    it to a ``test_...`` name): ``results(world)``, the per-rank results of a world that ran every case of
    its size, once per size (at the first item that needs it, then cached); ``before()`` first in every
    item (a skip); an item fails with the texts of the ranks where its case failed."""
    import pytest

    results = functools.lru_cache(maxsize=None)(results)

    @pytest.mark.parametrize("world,case_id", params)
    def test_case(world, case_id):
        before()
        failures = case_failures(results(world), case_id)
        assert not failures, "\n".join(failures)

    return test_case


def gloo_case_test(cases_module, world_sizes):
    """``world_case_test`` of every case of a case module (``make_cases(world)``, ``run_cases``) on gloo with
    CPU tensors, one item per case, ``test_case[w<world>-<case id>]``."""
    import pytest

    params = [pytest.param(world, case["id"], id=f"w{world}-{case['id']}")
              for world in world_sizes for case in cases_module.make_cases(world)]
    return world_case_test(params, lambda world: run_world(
        world, "gloo", cases_module.run_cases, {"device": "cpu", "cases": cases_module.make_cases(world)}))


def run_spawned(target, *args, timeout_s: float = 240):
    """``target(*args, queue)`` in a fresh ``spawn``-ed process, as SGLang starts a scheduler and vLLM a
    worker; returns the one result it queues (a dict; an ``"error"`` key fails the caller's test with the
    child's traceback)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    try:
        out = queue.get(timeout=timeout_s)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert "error" not in out, out["error"]
    return out
