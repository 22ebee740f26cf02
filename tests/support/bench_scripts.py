"""What the benchmark tests share: a module of benchmarks/ imported by name (benchmarks/ is no package)."""

import csv
import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    """``benchmarks/<name>.py`` as a module (imported once per process, as any module)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def csv_rows(path) -> list:
    """A CSV a benchmark wrote, as dicts (the file closed before the test goes on)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
