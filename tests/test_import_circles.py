"""No two modules of rollout_cluster import each other, directly or around a circle, counting
the imports inside functions too (a lazy import still ties the two modules' designs together).
Regression: client/ <-> serve/app.py (the Gateway imported the driver, the driver the builder)
and bench/run.py <-> bench/vllm_run.py."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict:
    out = {}
    for path in (ROOT / "rollout_cluster").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: dict) -> set:
    """The rollout_cluster modules `name` imports anywhere in its file, with their packages."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            found |= {m for m in (".".join(parts[:k]) for k in range(1, len(parts) + 1))
                      if m in known and m != name and not name.startswith(m + ".")}
    return found


def circles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_around_a_circle():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert "rollout_cluster.client.loops" in graph["rollout_cluster.serve.gateway"]  # the resolver works
    found = circles(graph)
    assert not found, " ; ".join(" <-> ".join(c) for c in found)
