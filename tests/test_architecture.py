"""The layering the README's Layout section promises, checked on the source (no imports run).

groundflow (CLI, demo) -> train, deploy -> policies -> guidance -> dataset, envs: train and deploy
never import each other, nothing below imports above, and no two modules import each other
(imports inside functions count: a lazy import does not make a cycle go away).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("envs", "dataset", "guidance", "policies", "train", "deploy", "groundflow")
ALLOWED = {  # package -> packages it may import
    "envs": {"envs"},
    "dataset": {"dataset", "envs"},
    "guidance": {"guidance", "envs"},
    "policies": {"policies", "guidance", "envs"},
    "train": {"train", "policies", "guidance", "dataset", "envs"},
    "deploy": {"deploy", "policies", "guidance", "dataset", "envs"},
    "groundflow": set(PACKAGES),
}
ALGORITHMS = {  # one home each: (file, name defined there and nowhere else)
    "CIG loss": ("train/cig.py", "cig_loss"),
    "flow-energy score": ("policies/flow.py", "energies"),
    "coupled step": ("guidance/coupled.py", "CoupledGuidance"),
    "real-time chunking": ("policies/rtc.py", "prefix_guide"),
    "debugging search": ("deploy/debugging/search.py", "attribute"),
    "dataset format": ("dataset/hdf5.py", "DatasetWriter"),
    "command table": ("groundflow/cli.py", "COMMANDS"),
}
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Project modules each module imports (anywhere in its body, TYPE_CHECKING blocks aside)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                # `import a.b.c` also runs a and a.b: the deepest project module named is the edge
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def test_layers_import_only_downward():
    mods = _modules()
    bad = [f"{a} -> {b}" for a, bs in _imports(mods).items() for b in sorted(bs)
           if b.split(".")[0] not in ALLOWED[a.split(".")[0]]]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_cycles():
    mods = _modules()
    edges = _imports(mods)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in mods:
        if module not in index:
            visit(module)
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_each_algorithm_has_one_home():
    defined: dict[str, list[str]] = defaultdict(list)
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined[node.name].append(str(path.relative_to(ROOT)))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        defined[target.id].append(str(path.relative_to(ROOT)))
    for what, (home, name) in ALGORITHMS.items():
        assert defined[name] == [home], f"{what}: {name} should be defined once, in {home}; found {defined[name]}"


def test_no_function_is_a_chapter():
    long = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(long)
