"""scripts/host_overhead_ab.py (the table of scripts/host_overhead_ab.sh) on logs in host_overhead.py's
format: medians over runs per tree, the after/before ratio, rows missing from a tree said, the floors and
plain collectives left out of the worst ratio."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_overhead_ab.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if row in l)
    assert line.split()[-4:] == ["105.0", "105.0", "1.000", "2/2"], line
    assert "P2P: only before" in out and "missing: before 2, after 0 runs" in out
    assert out.strip().endswith("worst nsa_cp row after/before: 1.000")  # the plain row's 1.43 is not nsa_cp's


def test_no_logs_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_overhead_ab.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "no host_overhead.py logs" in proc.stderr
