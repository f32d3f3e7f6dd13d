"""The scheduling policy stays pure (STYLE.md rule 1): the Ray Serve router, the simulator and the
unit tests drive the same code, so it must not import transport, engines or a clock."""
import ast
from pathlib import Path

import pytest

# The simulator itself may read a wall clock: it measures the decision time of these modules.
PURE = ["policy", "router", "engines/cost_model.py", "engines/sim_core.py", "sim/engine.py"]
FORBIDDEN = {"ray", "vllm", "asyncio", "prometheus_client", "time", "torch"}
PKG = Path(__file__).resolve().parents[1] / "rollout_cluster"


def modules():
    for entry in PURE:
        path = PKG / entry
        yield from (sorted(path.glob("*.py")) if path.is_dir() else [path])


@pytest.mark.parametrize("path", list(modules()), ids=lambda p: str(p.relative_to(PKG)))
def test_pure_module_imports_nothing_forbidden(path):
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    assert not names & FORBIDDEN, f"{path.name} imports {sorted(names & FORBIDDEN)}"
