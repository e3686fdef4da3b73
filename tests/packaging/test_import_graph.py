"""No import cycle in the package: every ``import`` counts, function-level ones included (a
cycle hidden inside a function is still a cycle, only a later-failing one)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"aibrix_operators": REPO / "plugins" / "aibrix_operators", "kvcache": REPO / "kvcache"}


def modules() -> dict[str, Path]:
    found = {}
    for root in ROOTS.values():
        for path in root.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join([*parts, *([base] if base else [])])
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in mods:  # the module a name belongs to
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the whole package was read
    assert graph["aibrix_operators.batch.merging"] >= {"aibrix_operators.batch.ordered_merge"}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_function_level_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_batch_core_imports_nothing_of_the_driver() -> None:
    """``batch/`` (validate, split, merge, the shard result log) is what the driver reads and
    writes, not the other way round: one arrow, driver -> batch (issue 38)."""
    graph = import_graph()
    back_up = sorted((m, t) for m, targets in graph.items() if m.startswith("aibrix_operators.batch.")
                     for t in targets if t.startswith("aibrix_operators.driver"))
    assert back_up == []
    assert "aibrix_operators.batch.shard_results" in graph["aibrix_operators.driver.runner"]


DEV_ROOM = {"aibrix_operators.localenv", "aibrix_operators.local_airflow"}


def test_no_production_module_or_dag_imports_the_dev_room() -> None:
    """``localenv`` and ``local_airflow`` know this checkout (its .work folder, a local Airflow):
    what a deployment runs must not reach them, or it would fall back to a folder of the
    installed package (issue 37: one node's disk). Locations and the allow-list are deployment
    settings (settings/locations.py, trust/deployment.py); the dev room sets them for local runs."""
    graph = import_graph()
    reaching = sorted((m, t) for m, targets in graph.items() if m not in DEV_ROOM
                      for t in targets if t in DEV_ROOM)
    assert reaching == []
    dags = sorted(p.name for p in (REPO / "dags").glob("*.py")
                  if any(room in p.read_text() for room in DEV_ROOM))
    assert dags == []
    # The check sees what it must: the dev room imports the package, not the other way round.
    assert "aibrix_operators.trust.policy" in graph["aibrix_operators.localenv"]


def imports_airflow(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "airflow" or n.startswith("airflow.") for n in names):
            return True
    return False


def test_the_trust_room_checks_without_airflow() -> None:
    """The allow-list checks and the redaction are plain code a driver pod, the router or a
    test can run without Airflow (issue 38: the trust room); only ``trust/deployment.py`` reads
    Airflow's config. Every module they reach counts, not only their own lines."""
    graph, mods = import_graph(), modules()
    reached, todo = set(), ["aibrix_operators.trust.policy", "aibrix_operators.trust.redact"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    assert sorted(m for m in reached if imports_airflow(mods[m])) == []
    assert "aibrix_operators.storage" in reached  # the walk follows the arrows
    assert imports_airflow(mods["aibrix_operators.trust.deployment"])
