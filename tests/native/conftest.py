"""What the build tests share: setup.py loaded as a module (its helpers, without running setup())."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("nsa_cp_setup_under_test", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)  # must not run setup(): guarded by __name__ == "__main__"
        yield mod
    finally:
        sys.modules.pop(spec.name, None)
