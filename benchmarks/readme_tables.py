"""The README's three "Measured" tables, printed as Markdown from one run's CSV (gather_scatter.py --csv).

    python benchmarks/readme_tables.py benchmarks/results/2xH200.csv

Every figure comes from the uneven configuration of each size (counts [M, 0.8M], the benchmark's
--imbalance 0.2): milliseconds (median over rounds, max over ranks) and the ratios to NCCL's even
collective on [M, H] per rank that the benchmark computed in the same run. So the README's numbers are
reproducible from the committed CSV, never typed in.
"""

import argparse
import csv
from collections import defaultdict

GATHER_COLUMNS = [
    ("even AG", "even_ag"),
    ("F.pad+AG", "fpad_ag"),
    ("F.pad+AG+compact", "fpad_ag_compact"),
    ("torch list AG", "list_ag"),
    ("**nsa padded (NCCL)**", "nsa_ag_padded"),
    ("**nsa compact (NCCL)**", "nsa_ag_compact"),
    ("**nsa padded (P2P auto)**", "nsa_ag_padded_auto"),
    ("**nsa compact (P2P auto)**", "nsa_ag_compact_auto"),
]
SCATTER_COLUMNS = [
    ("even RS", "even_rs"),
    ("torch list RS", "list_rs"),
    ("**nsa padded RS (NCCL)**", "nsa_rs_padded"),
    ("**nsa compact RS (NCCL)**", "nsa_rs_compact"),
    ("**nsa padded RS (P2P auto)**", "nsa_rs_padded_auto"),
    ("**nsa compact RS (P2P auto)**", "nsa_rs_compact_auto"),
]
# (header, method, field, format)
RATIO_COLUMNS = [
    ("P2P padded gather (auto) / even AG", "nsa_ag_padded_auto", "x_even", "{:.3f}"),
    ("compact (auto)", "nsa_ag_compact_auto", "x_even", "{:.3f}"),
    ("SM kernel alone (padded)", "p2p_ag_padded_sm", "x_even", "{:.3f}"),
    ("link GB/s (auto, rank 0 -> peer)", "nsa_ag_padded_auto", "link_GBps", "{:.0f}"),
    ("P2P padded RS / even RS", "nsa_rs_padded_auto", "x_even", "{:.3f}"),
    ("P2P compact RS / even RS", "nsa_rs_compact_auto", "x_even", "{:.3f}"),
]


def uneven_rows(path):
    """{M: {method: csv row}} for the uneven configuration of every size (the one with padding)."""
    by_m = defaultdict(dict)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if float(row["padding_frac"]) > 0:
                by_m[int(row["max_rank_len"])][row["method"]] = row
    return dict(sorted(by_m.items()))


def table(header, lines):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def render(path) -> str:
    rows = uneven_rows(path)

    def ms(m, method):
        return f"{float(rows[m][method]['time_ms']):.3f}" if method in rows[m] else "n/a"

    def field(m, method, name, fmt):
        return fmt.format(float(rows[m][method][name])) if method in rows[m] else "n/a"

    parts = [
        table(["M"] + [h for h, _ in GATHER_COLUMNS], [[str(m)] + [ms(m, k) for _, k in GATHER_COLUMNS] for m in rows]),
        table(["M"] + [h for h, _ in SCATTER_COLUMNS], [[str(m)] + [ms(m, k) for _, k in SCATTER_COLUMNS] for m in rows]),
        table(
            ["M"] + [h for h, *_ in RATIO_COLUMNS],
            [[str(m)] + [field(m, k, f, fmt) for _, k, f, fmt in RATIO_COLUMNS] for m in rows],
        ),
    ]
    return "\n\n".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="a CSV written by benchmarks/gather_scatter.py --csv")
    print(render(parser.parse_args(argv).csv))


if __name__ == "__main__":
    main()
