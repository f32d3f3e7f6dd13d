"""Fixtures shared by the unit tests (the e2e cluster fixtures live in tests/e2e/)."""
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a module (scripts are not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # a script's dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def headroom():
    return load_script("isolation_headroom")


@pytest.fixture(scope="session")
def balance_gap():
    return load_script("balance_gap")


@pytest.fixture(scope="session")
def length_hints():
    return load_script("length_hints")


@pytest.fixture(scope="session")
def fleet_scale_plot():
    return load_script("fleet_scale_plot")


@pytest.fixture(scope="session")
def pull_budget():
    return load_script("pull_budget")


@pytest.fixture(scope="session")
def partial_rollouts_sim():
    return load_script("partial_rollouts_sim")
