"""The README and docs/ state what the repository holds: figures from the committed CSV, every variable.

* The README's performance table and docs/performance.md's tables are printed by
  ``benchmarks/readme_tables.py`` from the CSV the README names: every table line must appear verbatim.
  A new run changes the CSV and the text together or this fails.
* The README's environment-variable table lists exactly ``nsa_cp.envs.ENVIRONMENT_VARIABLES``, each
  with its default.
* Local links resolve; the two one-line commands are there; no numbered-run citations.
"""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _readme_tables():
    return _load("readme_tables", ROOT / "benchmarks" / "readme_tables.py")


def _section(text: str, title: str) -> str:
    """The body of the '## title' section of a Markdown text (up to the next '## ')."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no '## {title}' section"
    return match.group(1)


def _named_csv(text: str) -> Path:
    named = re.search(r"python benchmarks/readme_tables\.py\s+(benchmarks/results/\S+?\.csv)", text)
    assert named, "the text must name the CSV its tables come from (python benchmarks/readme_tables.py <csv>)"
    path = ROOT / named.group(1)
    assert path.is_file(), path
    return path


def _table_lines(text: str):
    return [line for line in text.splitlines() if line.startswith("|")]


def test_readme_performance_table_comes_from_the_named_csv():
    readme = README.read_text()
    section = _section(readme, "Performance")
    csv_path = _named_csv(section)
    rendered = _readme_tables().render(csv_path).splitlines()
    lines = _table_lines(section)
    assert len(lines) >= 3, "the Performance section must hold a table (header, rule, rows)"
    missing = [line for line in lines if line not in rendered]
    assert not missing, f"README table lines not printed from {csv_path.name}:\n" + "\n".join(missing)
    # the whole table, not a fragment: every row of the rendered table that starts with the same header
    header = rendered.index(lines[0])
    end = next((i for i in range(header, len(rendered)) if not rendered[i].startswith("|")), len(rendered))
    assert lines == rendered[header:end], "the README's table must be one whole table of readme_tables.py"


def test_performance_doc_holds_every_table_of_the_csv():
    csv_path = _named_csv(_section(README.read_text(), "Performance"))
    assert _named_csv(PERFORMANCE.read_text()) == csv_path, "docs/performance.md must name the README's CSV"
    rendered = _readme_tables().render(csv_path)
    assert rendered in PERFORMANCE.read_text(), (
        f"docs/performance.md must hold `python benchmarks/readme_tables.py {csv_path.relative_to(ROOT)}`'s "
        "output verbatim:\n" + rendered
    )


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


def _default_text(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def test_readme_lists_every_environment_variable_with_its_default(monkeypatch):
    envs = _load("_nsa_cp_envs", ROOT / "nsa_cp" / "envs.py")  # the file alone: no package import, no torch

    rows = {}
    for line in _table_lines(_section(README.read_text(), "Environment variables"))[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0].strip("`")
        default = re.match(r"`([^`]*)`", cells[1])
        rows[name] = default.group(1) if default else cells[1]
    assert set(rows) == set(envs.ENVIRONMENT_VARIABLES), (
        f"missing from the README: {sorted(set(envs.ENVIRONMENT_VARIABLES) - set(rows))}; "
        f"not in nsa_cp/envs.py: {sorted(set(rows) - set(envs.ENVIRONMENT_VARIABLES))}"
    )
    for name, (reader, _) in envs.ENVIRONMENT_VARIABLES.items():
        monkeypatch.delenv(name, raising=False)
        default = reader()
        if default == "":  # decided elsewhere (NSA_CP_CUDA_ARCHS: setup.py's nvcc probe)
            continue
        assert rows[name] == _default_text(default), f"{name}: README says {rows[name]!r}, envs.py {default!r}"


def test_readme_has_the_two_one_line_commands():
    readme = README.read_text()
    assert "python -m pip install -e . && python benchmarks/gather_scatter.py\n" in readme
    assert 'python -m pip install -e ".[test]" && python -m pytest tests\n' in readme
    assert len(readme.splitlines()) <= 160, "the README is for users: at most 160 lines"


@pytest.mark.parametrize("path", [README] + DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(path):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    local = [link for link in links if "://" not in link]
    broken = [link for link in local if not (path.parent / link).exists()]
    assert not broken, f"{path.name}: links to nothing: {broken}"


def test_readme_links_every_doc():
    readme = README.read_text()
    unlinked = [doc.name for doc in DOCS if f"(docs/{doc.name})" not in readme]
    assert not unlinked, f"docs the README does not link: {unlinked}"


# the code's comments and docstrings too: a figure there names its measurement as well
CODE = sorted(p for d in ("nsa_cp", "csrc") for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".cu", ".cuh", ".cpp", ".h"))


@pytest.mark.parametrize(
    "path", [README, ROOT / "CHANGELOG.md"] + DOCS + CODE, ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_numbered_run_citations(path):
    """Figures name their measurement (machine, dtype, size), never a numbered run or a journal."""
    hits = [
        f"{path.name}:{i}: {line.strip()}"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bruns? [0-9]+|\brun[0-9]+|gpu_runs|gpu_logs", line, re.I)
    ]
    assert not hits, "\n".join(hits)
