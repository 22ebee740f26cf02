"""scripts/p2p_host_layers.py: the P2P path's Python layers on CPU with the native launches stubbed.

It runs on this tree, every public P2P call of benchmarks/host_overhead.py gives a row, and each row's
Python calls per call stay within a budget: a count (not a time), so it guards the hot path against a
new frame or lookup per call without timing anything. The budgets are the counts at the time of writing
plus 2 for calls torch versions may add (torch 2.11-2.14)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUDGET = {  # Python calls per public call (sys.setprofile "call" + "c_call"), with torch 2.13 CPU: +2
    "cp_all_gather padded": 30 + 2,
    "cp_all_gather padded, out=": 37 + 2,
    "cp_all_gather compact": 30 + 2,
    "cp_all_gather compact, out=": 37 + 2,
    "cp_reduce_scatter padded, out=": 32 + 2,
    "cp_reduce_scatter compact, out=": 32 + 2,
    "fused_add_rmsnorm_all_gather padded": 51 + 2,
    "reduce_scatter_fused_add_rmsnorm padded": 48 + 2,
}


@pytest.fixture(scope="module")
def rows():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "p2p_host_layers.py"), "--rounds", "20"],
                          capture_output=True, text=True, timeout=300, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for line in proc.stdout.splitlines():  # "  {name:<48}{us:9.2f}   {calls:6.1f} py calls"
        if line.endswith(" py calls"):
            parts = line.split()
            found[line[2:50].strip()] = (float(parts[-4]), float(parts[-3]))
    assert str(ROOT) in proc.stdout  # this tree's nsa_cp, not an installed one
    return found


def test_every_p2p_call_has_a_row(rows):
    assert set(BUDGET) <= set(rows), sorted(rows)
    assert all(us > 0 for us, _ in rows.values())


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_python_calls_per_call_within_budget(rows, name):
    assert rows[name][1] <= BUDGET[name], f"{name}: {rows[name][1]} Python calls per call, budget {BUDGET[name]}"
