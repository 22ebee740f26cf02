"""The README's measured tables are the committed benchmark CSV's, not typed-in figures.

``benchmarks/readme_tables.py`` renders the three "Measured" tables from the CSV the README names; every
line it prints must appear in the README verbatim. A new run changes both together or this fails.
"""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measured_tables_come_from_the_named_csv():
    readme = (ROOT / "README.md").read_text()
    named = re.search(r"python benchmarks/readme_tables\.py (benchmarks/results/\S+\.csv)", readme)
    assert named, "the README must name the CSV its tables come from"
    csv_path = ROOT / named.group(1).rstrip("`")
    assert csv_path.is_file(), csv_path
    rendered = _readme_tables().render(csv_path)
    table_lines = [line for line in rendered.splitlines() if line.startswith("| ")]
    assert len(table_lines) == 3 * (1 + 4), rendered  # three tables: a header and four sizes each
    missing = [line for line in table_lines if line not in readme]
    assert not missing, "README tables differ from " + named.group(1) + ":\n" + "\n".join(missing)


def test_tables_take_the_uneven_configuration(tmp_path):
    """Ratios and times come from the padded configuration of each size, never the even one."""
    module = _readme_tables()
    header = "counts,max_rank_len,padding_frac,method,time_ms,x_even,link_GBps\n"
    rows = [
        "8/8,8,0.0,nsa_ag_padded_auto,9.0,1.0,1.0",
        "8/6,8,0.125,nsa_ag_padded_auto,0.5,0.25,300.0",
        "8/6,8,0.125,even_ag,2.0,1.0,100.0",
    ]
    path = tmp_path / "run.csv"
    path.write_text(header + "\n".join(rows) + "\n")
    out = module.render(path)
    assert "| 8 | 2.000 | n/a |" in out  # even AG of the uneven configuration; the rest not measured
    assert "| 8 | 0.250 | n/a | n/a | 300 | n/a | n/a |" in out
    assert "9.000" not in out
