"""Fixtures shared by the unit tests (the e2e cluster fixtures live in tests/e2e/)."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

# Every router and replica the tests make verifies and signs control orders with this key (as a
# deployment reads it from security.control_keys_file or $ROLLOUT_CONTROL_KEYS).
TEST_CONTROL_KEYS = "tests-key " + "k" * 48
os.environ.setdefault("ROLLOUT_CONTROL_KEYS", TEST_CONTROL_KEYS)

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def load_experiment(folder: str, name: str):
    """experiments/<folder>/run.py as the module `name` (experiments are not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / folder / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # a script's dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def headroom():
    return load_experiment("isolation-headroom", "isolation_headroom")


@pytest.fixture(scope="session")
def balance_gap():
    return load_experiment("balance-gap", "balance_gap")


@pytest.fixture(scope="session")
def length_hints():
    return load_experiment("length-hints", "length_hints")


@pytest.fixture(scope="session")
def fleet_scale_plot():
    return load_experiment("fleet-scale", "fleet_scale_plot")


@pytest.fixture(scope="session")
def pull_budget():
    return load_experiment("pull-budget", "pull_budget")


@pytest.fixture(scope="session")
def partial_rollouts_sim():
    return load_experiment("partial-rollouts", "partial_rollouts_sim")
