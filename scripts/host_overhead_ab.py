"""The table of scripts/host_overhead_ab.sh: per row of benchmarks/host_overhead.py, the median over runs
of each tree's host microseconds and the ratio after / before; last, the worst ratio of nsa_cp's rows
(the floors and the plain collectives are not nsa_cp's code: they show the noise of the run).

    python scripts/host_overhead_ab.py OUT_DIR     # reads OUT_DIR/ho_{before,after}_M<m>[s<n>]_<run>.txt
"""

import glob
import os
import re
import statistics
import sys

ROW = re.compile(r"^  (\S.*?)\s{2,}([0-9.]+)(\s|$)")
CALLS = re.compile(r"([0-9.]+) py calls$")
NAME = re.compile(r"ho_(before|after)_M(\d+(?:s\d+)?)_\d+\.txt$")


def read(out_dir):
    """``{(size, row): {"before": [us...], "after": [us...]}}`` from every run's log."""
    rows = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "ho_*_M*_*.txt"))):
        match = NAME.search(os.path.basename(path))
        if not match:
            continue
        tree, size = match.groups()
        with open(path) as f:
            for line in f:
                row = ROW.match(line)
                if row and not line.lstrip().startswith("("):
                    entry = rows.setdefault((size, row.group(1).strip()), {})
                    entry.setdefault(tree, []).append(float(row.group(2)))
                    calls = CALLS.search(line.rstrip())
                    if calls:
                        entry.setdefault(tree + " calls", []).append(float(calls.group(1)))
    return rows


def main(out_dir):
    rows = read(out_dir)
    if not rows:
        raise SystemExit(f"no host_overhead.py logs under {out_dir}")
    print(f"{'M':>7}  {'row':<52}{'before us':>10}{'after us':>10}{'after/before':>14}  runs  py calls before/after")
    worst, noise = None, []
    for (size, name), v in sorted(rows.items()):
        before, after = v.get("before", []), v.get("after", [])
        if not before or not after:
            print(f"{size:>7}  {name:<52} missing: before {len(before)}, after {len(after)} runs")
            continue
        b, a = statistics.median(before), statistics.median(after)
        ratio = a / b if b else float("nan")
        if not name.startswith(("floor", "plain", "F.pad")):
            worst = ratio if worst is None else max(worst, ratio)
        else:
            noise.append(ratio)
        calls = ""
        if v.get("before calls") and v.get("after calls"):
            calls = f"  {statistics.median(v['before calls']):7.1f} / {statistics.median(v['after calls']):.1f}"
        print(f"{size:>7}  {name:<52}{b:10.1f}{a:10.1f}{ratio:14.3f}  {len(before)}/{len(after)}{calls}")
    print(f"worst nsa_cp row after/before: {worst:.3f}" if worst is not None else "no nsa_cp row in both trees")
    if noise:  # the same code in both trees: their spread is the run's noise
        print(f"floors and plain collectives (not nsa_cp's code) after/before: {min(noise):.3f} to {max(noise):.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
