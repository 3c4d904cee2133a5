"""The house rules that the code's shape must keep: no import circles (imports inside functions count), the
authoring kit imports no method, no private Ray or PyTorch API, and the example plugin needs only the kit."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("fedsim", "actors", "jobs")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (Path(ROOT) / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere in it (functions included), TYPE_CHECKING blocks excepted."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        found.update(t for t in map(resolve, names) if t and t != module)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
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
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_counting_imports_inside_functions():
    known = _modules()
    graph = {m: _imports(p, m, known) for m, p in known.items()}
    assert _cycles(graph) == []
    graph["fedsim.registry"].add("fedsim.config.schema")  # the checker itself finds a circle when there is one
    graph["fedsim.config.schema"] = graph["fedsim.config.schema"] | {"fedsim.registry"}
    assert _cycles(graph) == [["fedsim.config.schema", "fedsim.registry"]]


def test_the_authoring_kit_imports_no_method_and_resolves_them_on_demand():
    code = ("import sys, fedsim.method as m\n"
            "assert not [k for k in sys.modules if k.startswith('fedsim.algorithms.')], 'a method was imported'\n"
            "assert 'ray' not in sys.modules\n"
            "print(m.get_algorithm('fedavg').__module__)\n"
            "print(sorted(k for k in sys.modules if k.startswith('fedsim.algorithms.')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["fedsim.algorithms.fedavg", "['fedsim.algorithms.fedavg']"]


def test_no_private_ray_or_torch_internals():
    """Nothing reaches into Ray's or PyTorch's private modules or attributes: an upgrade breaks those silently."""
    banned = ("ray._private", "ray._raylet", "_global_node", "_load_from_state_dict", "_state_dict_hooks",
              "_load_state_dict_pre_hooks", "torch._foreach", "torch._dynamo", "torch._C")
    hits = [f"{m}: {b}" for m, p in _modules().items() for b in banned if b in p.read_text()]
    assert hits == []


def test_the_example_plugin_imports_only_the_kit_and_the_method_it_extends():
    tree = ast.parse((Path(ROOT) / "examples" / "my_method.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
        a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    project = {m for m in imported if m and m.split(".")[0] in PACKAGES}
    assert project == {"fedsim.method", "fedsim.algorithms.fedavg"}
