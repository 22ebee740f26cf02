"""Plot bandwidth against size from a gather_scatter.py CSV: one panel per operation, the baselines a user
would pick and nsa_cp's best paths; writes a PNG beside the CSV.

    python benchmarks/plot_busbw.py benchmarks/results/2xH200.csv [--imbalance 0.2] [--out x.png]

Needs matplotlib (``pip install -e ".[bench]"``). For the layouts whose second rank holds
round(M * (1 - imbalance)) rows: x = M, rows per rank slot (with the slot's MB); y = bandwidth on real
rows, the ``link_GBps`` column (the busiest rank's real bytes sent to its peers over the time; the same
numerator for every method of a size, so it ranks methods as time does, and padded and compact methods
compare on one scale). At most six lines per panel (``LINES``); a method the CSV lacks (a CPU run has
no P2P rows) is left out. The title names the machine, the versions and the date from the CSV's tags;
a CPU run's plot says it is a smoke run.
"""

import argparse
import csv
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

# (direction, panel title, [(method, label, colour, line style, marker)]), colours of the Okabe-Ito
# palette (readable for colour-blind readers); dashed lines are baselines, solid ones nsa_cp
_BASE = {"even": ("#000000", "--", "s"), "fpad": ("#E69F00", "--", "v"), "list": ("#009E73", "-.", "D"),
         "nccl": ("#0072B2", "-", "o"), "p2p": ("#D55E00", "-", "^")}
LINES = [
    ("ag", "all-gather", [
        ("even_ag", "NCCL all-gather, even [M, H] per rank (the reference)", *_BASE["even"]),
        ("fpad_ag", "F.pad + NCCL all-gather (padded output)", *_BASE["fpad"]),
        ("list_ag", "torch list all-gather, uneven (compact output)", *_BASE["list"]),
        ("nsa_ag_padded", "nsa_cp cp_all_gather, NCCL path (padded)", *_BASE["nccl"]),
        ("nsa_ag_compact_auto", "nsa_cp cp_all_gather, P2P (compact; padded is the same)", *_BASE["p2p"]),
    ]),
    ("rs", "reduce-scatter", [
        ("even_rs", "NCCL reduce-scatter, even [M, H] per rank (the reference)", *_BASE["even"]),
        ("list_rs", "torch list reduce-scatter, uneven (compact input)", *_BASE["list"]),
        ("nsa_rs_compact", "nsa_cp cp_reduce_scatter, NCCL path (compact)", *_BASE["nccl"]),
        ("nsa_rs_padded_auto", "nsa_cp cp_reduce_scatter, P2P (padded; compact is the same)", *_BASE["p2p"]),
    ]),
]
assert all(len(lines) <= 6 for _, _, lines in LINES)


def load(path, imbalance):
    """``(series, tags)``: (direction, method) -> sorted [(M, slot MB, GB/s)], and the first row's tags."""
    series, tags = defaultdict(list), None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if "direction" not in row or "link_GBps" not in row:
                raise SystemExit(f"{path}: not a CSV of benchmarks/gather_scatter.py (no direction / link_GBps)")
            tags = tags or row
            counts = [int(c) for c in row["counts"].split("/")]
            m = int(row["max_rank_len"])
            if len(counts) < 2 or counts[1] != round(m * (1 - imbalance)):
                continue
            slot_mb = m * int(row["hidden"]) * (2 if row["dtype"] in ("bf16", "fp16") else 4) / 1e6
            series[(row["direction"], row["method"])].append((m, slot_mb, float(row["link_GBps"])))
    for points in series.values():
        points.sort()
    return series, tags or {}


def title_of(tags, imbalance) -> str:
    what = f"uneven counts [M, {1 - imbalance:g}M], {tags.get('dtype', '?')}, H = {tags.get('hidden', '?')}"
    date = str(tags.get("date", "?"))[:10]
    if harness.is_smoke(tags):
        return (f"CPU smoke run (gloo, {tags.get('world', '?')} ranks), {date}: it checks the harness; "
                f"these numbers say nothing about GPUs\n{what}")
    return (f"{tags.get('gpu', '?')} x{tags.get('world', '?')}, torch {tags.get('torch', '?')}, "
            f"NCCL {tags.get('nccl', '?')}, {date}\n{what}; device time, median over rounds, max over ranks")


def plot(series, tags, imbalance, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 6.4))
    for ax, (direction, name, lines) in zip(axes, LINES):
        sizes = {}
        for method, label, colour, style, marker in lines:
            points = series.get((direction, method))
            if not points:
                continue
            ms, mbs, ys = zip(*points)
            sizes.update(zip(ms, mbs))
            if tags.get("backend") == "gloo":  # the process group's collectives are gloo's there
                label = label.replace("NCCL", "gloo")
            ax.plot(ms, ys, style, color=colour, marker=marker, markersize=6, linewidth=2, label=label)
        ax.set_xscale("log", base=2)
        if sizes:
            ticks = sorted(sizes)
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{m}\n{sizes[m]:.3g} MB" for m in ticks])
            ax.minorticks_off()
        ax.set_xlabel("M, rows per rank slot (and the slot's size)")
        ax.set_ylabel("GB/s on real rows (busiest rank's bytes sent / time)")
        ax.set_ylim(bottom=0)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        # below the axes: the legend covers no data
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8.5, frameon=False, ncol=1)
    fig.suptitle(title_of(tags, imbalance), fontsize=10.5)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--imbalance", type=float, default=0.2)
    parser.add_argument("--out", default=None, help="PNG path (default: the CSV's, .png)")
    args = parser.parse_args(argv)
    out = args.out or os.path.splitext(args.csv)[0] + ".png"
    harness.check_output_paths([("--out", out)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit('plot_busbw.py needs matplotlib: pip install -e ".[bench]"') from None
    series, tags = load(args.csv, args.imbalance)
    if not series:
        raise SystemExit(f"{args.csv}: no rows with counts [M, round(M * {1 - args.imbalance:g})] (--imbalance)")
    plot(series, tags, args.imbalance, out)
    print(out)


if __name__ == "__main__":
    main()
