"""The example exits cleanly: 20 torchrun launches on CPU, 20 exits with status 0.

The cause of the abort this guards against: nsa_cp's plan cache holds the process group each plan was
built for, so after ``dist.destroy_process_group()`` a gloo group used by an nsa_cp collective stayed
alive, its worker threads included, into interpreter finalization. A worker thread that then released
the last reference to the last collective's tensor needed the GIL, was ended by the finalizing
interpreter inside a destructor and took the process down with ``terminate called without an active
exception`` (SIGABRT) after the example had printed ok=True: 7 of 16 launches on a 2-core machine
before nsa_cp/planning/plan.py emptied the cache at exit. The second test checks that cause directly: after a
gather and a reduce-scatter, ``destroy_process_group()`` and the exit handlers, no gloo thread is left.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "nsa_prefill.py")
LAUNCHES = 20
PARALLEL = 2  # launches at a time: each is three processes, mostly interpreter start-up
# small: the abort came at exit, whatever the size; both splits, both methods (gloo collectives of each)
SMALL = ["--device", "cpu", "--comm", "both", "--layers", "1", "--seq-lens", "37,21,9", "--page-size", "8"]
ARGVS = [SMALL + ["--enable-nsa-prefill-cp-shared-kv"], SMALL]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))


def _launch(i):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE,
           *ARGVS[i % len(ARGVS)]]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def test_example_exits_cleanly_20_times():
    failures, done, running = [], 0, []
    next_i = 0
    while done < LAUNCHES:
        while len(running) < PARALLEL and next_i < LAUNCHES:
            running.append((next_i, _launch(next_i)))
            next_i += 1
        i, proc = running.pop(0)
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"launch {i}: no exit within 180 s\n{out[-2000:]}{err[-2000:]}")
            done += 1
            continue
        done += 1
        problems = []
        if proc.returncode != 0:
            problems.append(f"exit status {proc.returncode}")
        if "terminate called" in err or "SIGABRT" in err:
            problems.append("aborted")
        if "ok=True" not in out:
            problems.append("no ok=True line")
        if problems:
            failures.append(f"launch {i} ({' '.join(ARGVS[i % len(ARGVS)])}): {', '.join(problems)}\n"
                            f"{out[-2000:]}{err[-3000:]}")
    assert not failures, f"{len(failures)} of {LAUNCHES} launches did not exit cleanly:\n" + "\n".join(failures)


_NO_THREADS_LEFT = r"""
import atexit, os, sys, torch, torch.distributed as dist
import nsa_cp

def gloo_threads():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    return [n for n in names if "gloo" in n]

dist.init_process_group("gloo")
rank = dist.get_rank()
layout = nsa_cp.ShardLayout([3, 1])
x = torch.randn(layout.per_rank_actual_token[rank], 8)
full = nsa_cp.cp_all_gather(x, layout)
mine = nsa_cp.cp_reduce_scatter(torch.randn(layout.padded_len, 8), layout)
assert gloo_threads(), "the probe sees no gloo thread while the group is alive"
del x, full, mine
dist.destroy_process_group()
atexit._run_exitfuncs()  # what the interpreter runs at exit, before it finalizes
left = gloo_threads()
print(f"rank {rank}: gloo threads after destroy_process_group and the exit handlers: {left}")
sys.exit(1 if left else 0)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to list the process's threads")
def test_no_gloo_thread_survives_destroy_and_exit_handlers(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(_NO_THREADS_LEFT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("gloo threads after destroy_process_group and the exit handlers: []") == 2, proc.stdout
