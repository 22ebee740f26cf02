"""The code's comments and docstrings (nsa_cp/, its integrations included, and csrc/) say why and give
shapes and contracts; they carry no dates and no issue or pull-request numbers. Those belong to the
history (git log, CHANGELOG.md) and measured figures to docs/performance.md, with their machine, size and
date. (Numbered runs are refused by tests/package/test_readme_figures.py, for the docs too.) A file of
the repository they name exists.

Python: every comment token and every module, class and function docstring. C++ / CUDA: the whole file
(its comments, and bindings.cpp's docstrings, which are string literals)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sorted((ROOT / "nsa_cp").rglob("*.py"))
NATIVE = sorted(p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp"))

# counted nouns after "issue(s) N" are hardware talk ("each warp issues 4 loads"), not an issue number
_COUNTED = r"(?!\s+(?:loads|stores|instructions|requests|bytes|rows|words|reads|writes|copies|launches))"
PATTERNS = {
    "a date": re.compile(r"\b(?:19|20)\d\d[-/](?:0[1-9]|1[0-2])[-/](?:0[1-9]|[12]\d|3[01])\b"),
    "an issue number": re.compile(r"\b[Ii]ssue\s*#\s*\d+|\b[Ii]ssues?\s+\d+\b" + _COUNTED),
    "a pull-request number": re.compile(r"\b(?:PR|[Pp]ull request)\s*#?\s*\d+\b"),
    "a #NN reference": re.compile(r"(?<![\w&%{])#\d{2,}\b"),
}


def _python_text(path: Path):
    """``(line, text)`` of every comment and docstring of a Python file."""
    source = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    tree = ast.parse(source, str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                first = body[0].lineno
                for offset, line in enumerate(body[0].value.value.splitlines()):
                    yield first + offset, line


def _native_text(path: Path):
    yield from enumerate(path.read_text().splitlines(), 1)


def hits(path: Path):
    lines = _python_text(path) if path.suffix == ".py" else _native_text(path)
    return [f"{path.relative_to(ROOT)}:{number}: {what}: {text.strip()}"
            for number, text in lines for what, pattern in PATTERNS.items() if pattern.search(text)]


@pytest.mark.parametrize("path", PYTHON + NATIVE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_date_or_issue_number_in_comments_and_docstrings(path):
    found = hits(path)
    assert not found, ("comments and docstrings say why, not when or in which issue (the history is git's; "
                       "figures go to docs/performance.md with machine, size and date):\n" + "\n".join(found))


# a path into the tree (not a glob: ``nsa_cp/_C*.so``)
_CITED = re.compile(r"\b((?:csrc|nsa_cp|scripts|docs|tests|benchmarks|examples)/[\w./-]*\w)(?![\w*])")


@pytest.mark.parametrize("path", PYTHON + NATIVE, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_files_exist(path):
    lines = _python_text(path) if path.suffix == ".py" else _native_text(path)
    missing = sorted({f"{path.relative_to(ROOT)}:{number}: {cited}" for number, text in lines
                      for cited in _CITED.findall(text) if not (ROOT / cited).exists()})
    assert not missing, "comments and docstrings name files that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("text, caught", [
    ("# measured 2026-12-01 on 2x H200", True),
    ("# see issue 37", True),
    ("# (issue #37)", True),
    ("# fixed in PR 12", True),
    ("# GitHub #123", True),
    ("# each warp issues 4 loads", False),
    ("# the FP8 stage is issue-bound", False),
    ("# call #1 of the sequence", False),
    ("# 2048 rows, 7168 columns", False),
])
def test_the_patterns(tmp_path, text, caught):
    """Each pattern on a comment and on a docstring line."""
    for source in (f'"""doc"""\n{text}\nx = 1\n', f'def f():\n    """{text[2:]}"""\n'):
        probe = tmp_path / "probe.py"
        probe.write_text(source)
        found = [what for _, line in _python_text(probe) for what, p in PATTERNS.items() if p.search(line)]
        assert bool(found) == caught, (source, found)
