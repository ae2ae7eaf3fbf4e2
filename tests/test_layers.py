"""The package's import structure: no import circles, no import from a lower layer to a higher one.

Read from the source with ``ast`` (nothing is imported). Every import of ``detector.*`` counts: at module
level, inside a function, and under ``if TYPE_CHECKING:`` (a type a module names is a module it knows). A
name imported from a package's ``__init__`` counts as an import of the submodule the ``__init__`` takes
it from.

The layers, lowest first (a module may import its own layer and the ones below):
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import REPO

PACKAGE = REPO / "detector"

LAYERS: list[tuple[str, ...]] = [
    # the floor: error types and their one-line report, where the non-Python folders are, key=value
    # arguments, config type checks, the machine's description; they import nothing of ours above them
    ("detector.errors", "detector.resources", "detector.cli", "detector.config", "detector.machine",
     "detector.outputs"),
    # the geometry floor: Boxes3D, BevGrid + voxelize, box masks and morphology, exact IoU (torch, NumPy only)
    ("detector.geometry",),
    ("detector.ops",),  # the sparse-block ops (compiled kernels and their reference)
    ("detector.nn",),  # sparse layers on the ops
    ("detector.data",),  # KITTI files, frames and batches, datasets, augmentation, masks from data, loaders
    ("detector.sim",),  # the LiDAR simulator: writes KITTI-format data
    ("detector.models",),  # the detector: plain nn.Modules
    # the KITTI metric; BEV pictures; the inference network as a .pt2 / ONNX program; memory estimates
    ("detector.eval", "detector.viz", "detector.export", "detector.memory"),
    # Lightning plumbing; a model from its config or its checkpoint (build)
    ("detector.module", "detector.callbacks", "detector.batch_size", "detector.build"),
    ("detector.tasks", "detector.predict"),  # train(cfg) / evaluate(cfg); a checkpoint run on frames (predict)
    ("detector.commands",),  # the command-line programs
    ("detector.bench",),  # the benchmarks and measuring tools behind scripts/ (nothing of ours imports them)
]
__doc__ += "\n".join(f"    {i}. {', '.join(layer)}" for i, layer in enumerate(LAYERS)) + "\n"

# Known exceptions, each to be deleted here when it is gone (test_known_exceptions_still_exist says when).
KNOWN_CIRCLES: dict[frozenset[str], str] = {}
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imported_names(tree: ast.AST, package: str) -> set[str]:
    """Dotted names of the imports in ``tree`` (relative ones resolved against ``package``)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.update(f"{module}.{a.name}" for a in node.names)  # a submodule, or a name in module
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _reexports(package: str) -> dict[str, str]:
    """{name: submodule} of the names a package's ``__init__`` imports from its own submodules."""
    out = {}
    for node in ast.walk(ast.parse(MODULES[package].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            src = f"{package}.{node.module}" if node.level == 1 else node.module
            if src in MODULES and src.startswith(package + "."):
                out.update({a.asname or a.name: src for a in node.names})
    return out


def _resolve(name: str) -> str | None:
    """The module of ours that ``name`` (a module, or a name inside one) belongs to."""
    while name:
        if name in MODULES:
            return name
        owner, _, attr = name.rpartition(".")
        if owner in MODULES and MODULES[owner].name == "__init__.py" and attr in _reexports(owner):
            return _reexports(owner)[attr]
        name = owner
    return None


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for mod, path in MODULES.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        names = _imported_names(ast.parse(path.read_text(), str(path)), package)
        targets = {_resolve(n) for n in names if n == "detector" or n.startswith("detector.")}
        graph[mod] = {t for t in targets if t is not None and t != mod and t != "detector"}
    return graph


def layer_of(mod: str) -> int | None:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if mod == prefix or mod.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    return None if best is None else best[0]


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, bs in graph.items() for b in bs
                  if layer_of(a) is not None and layer_of(b) is not None and layer_of(a) < layer_of(b))


GRAPH = import_graph()


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if m != "detector" and layer_of(m) is None)
    assert not missing, f"put these modules in a layer of tests/test_layers.py LAYERS: {missing}"


def test_no_new_import_circle():
    new = [sorted(c) for c in circles(GRAPH) if c not in KNOWN_CIRCLES]
    assert not new, f"import circles: {new}"


def test_no_new_import_from_a_lower_layer_to_a_higher_one():
    new = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
           for a, b in upward_imports(GRAPH) if (a, b) not in KNOWN_UPWARD]
    assert not new, "imports that run back up:\n" + "\n".join(new)


def test_known_exceptions_still_exist():
    """A known exception that is gone must leave the lists, so that it cannot come back unnoticed."""
    found = set(circles(GRAPH))
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    up = set(upward_imports(GRAPH))
    gone += [list(e) for e in KNOWN_UPWARD if e not in up]
    assert not gone, f"no longer true, delete from KNOWN_CIRCLES / KNOWN_UPWARD: {gone}"


@pytest.mark.parametrize("source, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [frozenset({"a", "b"})]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [frozenset({"a", "b", "c"})]),
    ({"a": {"b"}, "b": set(), "c": {"a", "b"}}, []),
])
def test_circle_finder(source, expected):
    assert sorted(map(sorted, circles(source))) == sorted(map(sorted, expected))


def test_the_walk_sees_function_level_relative_and_type_checking_imports():
    src = ("from typing import TYPE_CHECKING\nfrom . import kitti\nif TYPE_CHECKING:\n"
           "    from detector.eval import kitti_metric\ndef f():\n    from ..models.nms import nms\n")
    names = _imported_names(ast.parse(src), "detector.data")
    assert {"detector.data.kitti", "detector.models.nms.nms", "detector.eval.kitti_metric"} <= names
    assert _resolve("detector.models.nms.nms") == "detector.models.nms"
    assert _resolve("detector.ops.sparse_gather") == "detector.ops.functional"  # through the package's face
    assert layer_of("detector.data.kitti") < layer_of("detector.models.nms") < layer_of("detector.eval.kitti_metric")
