"""The table of scripts/host_overhead_ab.sh: per row of benchmarks/host_overhead.py, the median over runs
of each tree's host microseconds, the ratio of those medians, and the paired ratio: the median over runs
of after_i / before_i, the two trees' run i having run side by side (at the same time, with
``CONCURRENT=1``, so a drift of the machine falls on both), and the same per floor: the median over
runs of (after_i / its floor_i) / (before_i / its floor_i), the floor being ``x.new_empty`` (host code,
the same in both trees) timed in the same rounds of the same process, so a process that ran slower as a
whole (two processes side by side on one host do not run alike) cancels out. Last, the worst of nsa_cp's
rows by both (the floors and the plain collectives are not nsa_cp's code: their spread is the noise of
the run).

    python scripts/host_overhead_ab.py OUT_DIR     # reads OUT_DIR/ho_{before,after}_M<m>[s<n>]_<run>.txt
"""

import glob
import os
import re
import statistics
import sys

ROW = re.compile(r"^  (\S.*?)\s{2,}([0-9.]+)(\s|$)")
CALLS = re.compile(r"([0-9.]+) py calls$")
NAME = re.compile(r"ho_(before|after)_M(\d+(?:s\d+)?)_(\d+)\.txt$")
CALIBRATOR = "floor: x.new_empty([P*M, H])"


def read(out_dir):
    """``{(size, row): {"before": {run: us}, "after": {run: us}, "before calls": [...], ...}}`` from every
    run's log."""
    rows = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "ho_*_M*_*.txt"))):
        match = NAME.search(os.path.basename(path))
        if not match:
            continue
        tree, size, run = match.groups()
        with open(path) as f:
            for line in f:
                row = ROW.match(line)
                if row and not line.lstrip().startswith("("):
                    entry = rows.setdefault((size, row.group(1).strip()), {})
                    entry.setdefault(tree, {})[int(run)] = float(row.group(2))
                    calls = CALLS.search(line.rstrip())
                    if calls:
                        entry.setdefault(tree + " calls", []).append(float(calls.group(1)))
    return rows


def main(out_dir):
    rows = read(out_dir)
    if not rows:
        raise SystemExit(f"no host_overhead.py logs under {out_dir}")
    print(f"{'M':>7}  {'row':<52}{'before us':>10}{'after us':>10}{'after/before':>14}{'paired':>8}"
          f"{'per floor':>10}  runs  py calls before/after")
    worst, worst_floor, noise = None, None, []
    for (size, name), v in sorted(rows.items()):
        before, after = v.get("before", {}), v.get("after", {})
        pairs = [after[i] / before[i] for i in sorted(set(before) & set(after)) if before[i]]
        if not pairs:
            print(f"{size:>7}  {name:<52} missing: before {len(before)}, after {len(after)} runs (none paired)")
            continue
        b, a = statistics.median(before.values()), statistics.median(after.values())
        ratio = statistics.median(pairs)
        fb, fa = rows.get((size, CALIBRATOR), {}).get("before", {}), rows.get((size, CALIBRATOR), {}).get("after", {})
        scaled = [(after[i] / fa[i]) / (before[i] / fb[i]) for i in sorted(set(before) & set(after) & set(fb) & set(fa))
                  if before[i] and fa[i]]
        per_floor = statistics.median(scaled) if scaled else None
        if not name.startswith(("floor", "plain", "F.pad")):
            worst = ratio if worst is None else max(worst, ratio)
            if per_floor is not None:
                worst_floor = per_floor if worst_floor is None else max(worst_floor, per_floor)
        else:
            noise.append(ratio)
        calls = ""
        if v.get("before calls") and v.get("after calls"):
            calls = f"  {statistics.median(v['before calls']):7.1f} / {statistics.median(v['after calls']):.1f}"
        floor_col = f"{per_floor:10.3f}" if per_floor is not None else f"{'-':>10}"
        print(f"{size:>7}  {name:<52}{b:10.1f}{a:10.1f}{a / b if b else float('nan'):14.3f}{ratio:8.3f}{floor_col}  "
              f"{len(before)}/{len(after)}{calls}")
    if worst is None:
        print("no nsa_cp row in both trees")
    else:
        print(f"worst nsa_cp row after/before (paired): {worst:.3f}"
              + (f"; per floor: {worst_floor:.3f}" if worst_floor is not None else ""))
    if noise:  # the same code in both trees: their spread is the run's noise
        print(f"floors and plain collectives (not nsa_cp's code) after/before (paired): {min(noise):.3f} to "
              f"{max(noise):.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
