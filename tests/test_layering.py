"""The layering of the code: which top-level package may import which. Every import is read from the source with
`ast` (those inside functions too: a lazy import is still an edge), relative ones resolved to their package.

The units: the packages (the top-level folders with an __init__.py), the library modules (the other top-level *.py:
batch.py, checkpoint.py, compile_cache.py) and the entry points (the top-level *.py with a `__main__` block:
train_ppo.py, train_sft.py, train_rm.py). tests/, bench/ and scripts/ are not scanned: they may import anything.

The rules: no cycle between the units; nothing imports an entry point; algo/ is tensor math (no torch.distributed, none
of the packages above it); parallel/ knows nothing of the roles, the algorithms, rollouts or tasks; rollout/ and tasks/
stay below roles/ and ppo/; recipes/ (a job's assets: a task plus an SFT warm start through roles/) is imported by the
entry points only."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from conftest import ROOT

# unit -> what no module of it may import (a module name, or any module below it)
FORBIDDEN = {
    "algo": ["torch.distributed", "parallel", "roles", "ppo", "rollout", "tasks", "recipes"],
    "parallel": ["algo", "roles", "ppo", "rollout", "tasks", "recipes"],
    "rollout": ["roles", "ppo", "recipes"],
    "tasks": ["roles", "ppo", "recipes"],
}


class Import:
    """One import statement: where (file:line), the modules it imports (dotted names) and its text."""

    def __init__(self, where: str, modules: list[str], statement: str):
        self.where, self.modules, self.statement = where, modules, statement

    def reaches(self, prefix: str) -> bool:
        """Whether it imports `prefix` or a module below it."""
        return any(m == prefix or m.startswith(prefix + ".") for m in self.modules)

    def __str__(self) -> str:
        return f"{self.where}: {self.statement}"


def layout(root: Path) -> tuple[list[str], list[str], list[str]]:
    """(packages, library modules, entry points) of the project at `root`."""
    packages = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    library, entry = [], []
    for path in sorted(root.glob("*.py")):
        (entry if has_main_block(path) else library).append(path.stem)
    return packages, library, entry


def has_main_block(path: Path) -> bool:
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test):
            return True
    return False


def module_imports(path: Path, root: Path) -> list[Import]:
    """Every module `path` imports, at any depth of the file (functions, classes, try blocks)."""
    rel = path.relative_to(root)
    package = list(rel.parts[:-1])  # where a relative import starts (for a/b/c.py and a/b/__init__.py alike: a.b)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                base = ".".join([*up, *([node.module] if node.module else [])])
            # `from torch import distributed` imports torch.distributed; `from x import name` is x (and x.name when
            # name is a module): both are listed, the rules match either
            names = [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
        else:
            continue
        out.append(Import(f"{rel}:{node.lineno}", names, ast.unparse(node)))
    return out


def scan(root: Path) -> dict[str, list[Import]]:
    """unit (a package, a library module or an entry point) -> the imports of all its modules."""
    packages, library, entry = layout(root)
    found: dict[str, list[Import]] = defaultdict(list)
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[package] += module_imports(path, root)
    for name in library + entry:
        found[name] += module_imports(root / f"{name}.py", root)
    return found


def edges(root: Path) -> dict[str, dict[str, Import]]:
    """unit -> {another unit it imports: one import that does it (the first found)}."""
    packages, library, entry = layout(root)
    units = set(packages) | set(library) | set(entry)
    graph: dict[str, dict[str, Import]] = {}
    for unit, found in scan(root).items():
        for imp in found:
            for top in {m.split(".")[0] for m in imp.modules} & units - {unit}:
                graph.setdefault(unit, {}).setdefault(top, imp)
    return graph


def find_cycle(graph: dict[str, dict[str, Import]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:  # back on the current path: the cycle is the path from nxt
                trail = path + [node]
                return trail[trail.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def cycle_report(root: Path) -> str | None:
    graph = edges(root)
    cycle = find_cycle(graph)
    if cycle is None:
        return None
    steps = [f"  {a} -> {b}: {graph[a][b]}" for a, b in zip(cycle, cycle[1:])]
    return "an import cycle between packages " + " -> ".join(cycle) + ":\n" + "\n".join(steps)


def forbidden_imports(root: Path, rules: dict[str, list[str]]) -> list[str]:
    found = scan(root)
    return [f"{unit}/ must not import {banned}: {imp}" for unit, banned_list in rules.items()
            for imp in found.get(unit, []) for banned in banned_list if imp.reaches(banned)]


def entry_point_imports(root: Path) -> list[str]:
    entry = layout(root)[2]
    return [f"{unit} imports the entry point {target}: {imp}" for unit, found in scan(root).items()
            for imp in found for target in entry if imp.reaches(target) and target != unit]


def recipes_importers(root: Path) -> list[str]:
    entry = set(layout(root)[2])
    return [f"{unit} imports recipes (only the entry points may): {imp}" for unit, found in scan(root).items()
            if unit not in entry and unit != "recipes" for imp in found if imp.reaches("recipes")]


# ---------------------------------------------------------------------------------------------------------- the rules
def test_the_scan_sees_the_units_the_rules_name():
    packages, library, entry = layout(ROOT)
    assert set(FORBIDDEN) | {"recipes", "roles", "ppo", "config"} <= set(packages), packages
    assert {"train_ppo", "train_sft", "train_rm"} <= set(entry), entry
    assert "batch" in library and not set(library) & set(entry), (library, entry)
    assert any(imp.reaches("recipes") for imp in scan(ROOT)["train_ppo"])  # inside a function (setup): counted


def test_no_cycle_between_packages():
    report = cycle_report(ROOT)
    assert report is None, report


def test_nothing_imports_an_entry_point():
    hits = entry_point_imports(ROOT)
    assert not hits, "\n".join(hits)


def test_each_layer_imports_only_what_is_below_it():
    hits = forbidden_imports(ROOT, FORBIDDEN)
    assert not hits, "\n".join(hits)


def test_only_the_entry_points_import_recipes():
    hits = recipes_importers(ROOT)
    assert not hits, "\n".join(hits)


def test_a_lazy_import_inside_a_function_is_caught(tmp_path):
    """The scan on a made-up project: tasks/ imports roles/ inside a function (relative to roles, from its package)
    while roles/ imports tasks/ at the top: a cycle, and tasks/ importing roles/ is forbidden."""
    for package in ("tasks", "roles", "recipes"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tasks" / "quickstart.py").write_text("def build():\n    from roles.sft import sft_train\n")
    (tmp_path / "roles" / "sft.py").write_text("from .helpers import x\nfrom tasks.data import load\n")
    (tmp_path / "roles" / "helpers.py").write_text("from ..recipes import y\n")
    (tmp_path / "train_x.py").write_text("import recipes\n\nif __name__ == '__main__':\n    pass\n")
    (tmp_path / "lib.py").write_text("import train_x\n")
    report = cycle_report(tmp_path)
    assert report and "roles -> tasks" in report and "tasks -> roles" in report, report
    assert "tasks/quickstart.py:2: from roles.sft import sft_train" in report, report
    hits = forbidden_imports(tmp_path, FORBIDDEN)
    assert hits == ["tasks/ must not import roles: tasks/quickstart.py:2: from roles.sft import sft_train"], hits
    assert recipes_importers(tmp_path) == [
        "roles imports recipes (only the entry points may): roles/helpers.py:1: from ..recipes import y"]
    assert entry_point_imports(tmp_path) == ["lib imports the entry point train_x: lib.py:1: import train_x"]
