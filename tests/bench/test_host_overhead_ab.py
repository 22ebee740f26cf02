"""scripts/host_overhead_ab.py (the table of scripts/host_overhead_ab.sh) on logs in host_overhead.py's
format: medians over runs per tree, the after/before ratio and the paired one, rows missing from a tree said, the floors and
plain collectives left out of the worst ratio."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _log(path, rows):
    lines = ["host microseconds per call, median of 300 interleaved rounds, max over 1 rank(s); M=256"]
    lines += [f"  {name:<48}{us:9.1f}   1.00x the plain collective" for name, us in rows.items()]
    lines += ["  (no native NCCL rows: a reason)", "", "cProfile, ...", "      300    0.001    0.000 plan.py:1(call)"]
    path.write_text("\n".join(lines) + "\n")


def test_table(tmp_path):
    row = "NCCL native: reduce_scatter_fused_add_rmsnorm padded"  # longer than the 48-column name field
    _log(tmp_path / "ho_before_M256_1.txt", {"plain all_gather_into_tensor": 20.0, row: 100.0, "P2P: only before": 9.0})
    _log(tmp_path / "ho_before_M256_2.txt", {"plain all_gather_into_tensor": 22.0, row: 110.0, "P2P: only before": 9.0})
    _log(tmp_path / "ho_after_M256_1.txt", {"plain all_gather_into_tensor": 30.0, row: 103.0})
    _log(tmp_path / "ho_after_M256_2.txt", {"plain all_gather_into_tensor": 30.0, row: 107.0})
    p2p = "P2P: cp_all_gather padded"
    for tree, us, calls in (("before", 30.0, 47.0), ("after", 33.0, 49.0)):  # short rows: calls follow the time
        (tmp_path / f"ho_{tree}_M256s2_1.txt").write_text(f"  {p2p:<48}{us:9.1f}{' ' * 29}   {calls:6.1f} py calls\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_overhead_ab.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if row in l)
    # medians 105 and 105; paired: median of 103/100 and 107/110
    assert line.split()[-6:] == ["105.0", "105.0", "1.000", "1.001", "-", "2/2"], line  # no floor row: "-"
    assert "P2P: only before" in out and "missing: before 2, after 0 runs" in out
    line = next(l for l in out.splitlines() if p2p in l)
    assert line.split()[-9:] == ["30.0", "33.0", "1.100", "1.100", "-", "1/1", "47.0", "/", "49.0"], line
    assert "worst nsa_cp row after/before (paired): 1.100" in out
    # the plain row's 1.43 is not nsa_cp's: it is the run's noise
    assert out.strip().endswith("floors and plain collectives (not nsa_cp's code) after/before (paired): 1.432 to 1.432")


def test_per_floor_ratio_cancels_a_slower_process(tmp_path):
    """Run 1's "after" process ran 20% slower as a whole (its floor too): paired 1.2, per floor 1.0; run 2
    ran alike and the row is 10% slower: the medians over the two runs."""
    floor, row = "floor: x.new_empty([P*M, H])", "P2P: cp_all_gather padded"
    for tree, run, us, fl in (("before", 1, 10.0, 5.0), ("after", 1, 12.0, 6.0),
                              ("before", 2, 10.0, 5.0), ("after", 2, 11.0, 5.0)):
        _log(tmp_path / f"ho_{tree}_M256s2_{run}.txt", {row: us, floor: fl})
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_overhead_ab.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if row in l)
    assert line.split()[-6:] == ["10.0", "11.5", "1.150", "1.150", "1.050", "2/2"], line
    assert "worst nsa_cp row after/before (paired): 1.150; per floor: 1.050" in out


def test_no_logs_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_overhead_ab.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "no host_overhead.py logs" in proc.stderr
