"""Fixtures shared by the unit tests (the e2e cluster fixtures live in tests/e2e/)."""
import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def headroom():
    """scripts/isolation_headroom.py as a module (it is a script, not part of the package)."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "isolation_headroom.py"
    spec = importlib.util.spec_from_file_location("isolation_headroom", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
