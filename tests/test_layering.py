"""The layers DESIGN.md draws, checked on the import graph of the source itself, and by
importing each layer alone in a fresh interpreter.

Every ``import`` of graphforge/ and passes/ (imported as graphforge.passes) is read with
``ast``, at module level and inside functions alike, leaving out ``if TYPE_CHECKING:``
blocks (annotations only). networkx then answers what each layer reaches, directly or
through others: a pass that imports a core module which imports the runtime reaches the
runtime. (Importing a submodule also runs its packages' ``__init__``; graphforge's own
re-exports everything, so the source's arrows are what is checked, not sys.modules.)
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]

#: the layers, lowest first; a module may import its own layer and those below it
CORE = (
    "graphforge.errors",
    "graphforge.tempfiles",
    "graphforge.ir",
    "graphforge.ort_compat",
    "graphforge.roles",
    "graphforge.graph",
    "graphforge.shapes",
    "graphforge.builder",
    "graphforge.analysis",
    "graphforge.constants",
    "graphforge.verify",
    "graphforge.program",
    "graphforge.pass_spec",
    "graphforge.pass_infra",
    "graphforge.placement",
)
PASSES = ("graphforge.passes",)
RUNTIME = ("graphforge.runtime",)
DISTRIBUTED = ("graphforge.distributed",)  # the runtime's schedules over torch.distributed
DRIVER = ("graphforge.pass_manager",)
TOOLS = (
    "graphforge.train",
    "graphforge.golden",
    "graphforge.diff",
    "graphforge.inspect_memory",
    "graphforge.inspect_host_syncs",
    "graphforge.torch",
)
TOP = ("graphforge.cli", "graphforge.__main__", "graphforge")  # the CLI, and the package's public re-exports
LAYERS = [CORE, PASSES, RUNTIME, DISTRIBUTED, DRIVER, TOOLS, TOP]
#: what only the runtime side may import (passes write what must happen into the model)
RUNTIME_ONLY_LIBRARIES = ("torch",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "passes":
        parts = ["graphforge", "passes", *parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for root in ("graphforge", "passes") for p in sorted((REPO / root).rglob("*.py"))}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            hidden |= {id(n) for n in ast.walk(node)}
    return hidden


def _in_functions(tree: ast.Module) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inside |= {id(n) for n in ast.walk(node) if n is not node}
    return inside


def _imports(modules: dict[str, Path]):
    """(importer, imported module or library, inside a function?) for every import."""
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        hidden, inside = _type_checking_only(tree), _in_functions(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in hidden or not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from package import submodule` imports the submodule
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                yield name, _known(target, modules), id(node) in inside


def _known(target: str, modules: dict[str, Path]) -> str:
    """The graphforge module a dotted import names (its longest known prefix), or the library."""
    probe = target
    while probe and probe not in modules:
        probe = probe.rpartition(".")[0]
    return probe or target.split(".")[0]


@pytest.fixture(scope="module")
def imports():
    modules = _sources()
    edges = list(_imports(modules))
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    graph.add_edges_from((a, b) for a, b, _ in edges if b in modules and a != b)
    return modules, edges, graph


def _layer(module: str) -> int:
    for index, layer in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in layer if prefix != "graphforge"):
            return index
    assert module == "graphforge", f"{module} belongs to no layer: add it to LAYERS"
    return len(LAYERS) - 1


def test_every_module_is_in_a_layer(imports):
    modules, _, _ = imports
    for module in modules:
        _layer(module)


def test_no_layer_reaches_a_layer_above_it(imports):
    """Directly or through others: passes never reach the runtime (nor the PassManager, the
    train loop, golden, diff or the CLI); the runtime never reaches train, golden or diff."""
    modules, _, graph = imports
    wrong = []
    for module in modules:
        for reached in nx.descendants(graph, module):
            if _layer(reached) > _layer(module):
                path = nx.shortest_path(graph, module, reached)
                wrong.append(" -> ".join(path))
    assert not wrong, "imports that reach a higher layer:\n" + "\n".join(sorted(wrong)[:20])


def test_no_import_cycles(imports):
    _, _, graph = imports
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_no_function_level_import_of_graphforge(imports):
    """A function-level import of graphforge hides an arrow (often one that would be a cycle)."""
    modules, edges, _ = imports
    hidden = sorted(f"{a} imports {b} inside a function" for a, b, inside in edges if inside and b in modules)
    assert not hidden, "\n".join(hidden)


def test_passes_never_import_torch_or_run_sessions(imports):
    """Passes write what must happen into the model; executing it is the runtime's. The one
    onnxruntime use in a pass is fold_constants quieting the sessions onnx-graphsurgeon makes
    to evaluate constants."""
    _, edges, _ = imports
    for importer, imported, _ in edges:
        if not importer.startswith("graphforge.passes"):
            continue
        assert imported not in RUNTIME_ONLY_LIBRARIES, f"{importer} imports {imported}"
        if imported == "onnxruntime":
            assert importer == "graphforge.passes.fold_constants", f"{importer} imports onnxruntime"


def test_torch_is_imported_nowhere_in_the_core(imports):
    """torch is an optional extra: no module of graphforge or its passes imports it but the
    PyTorch front end (graphforge/torch/, to come) and graphforge/distributed/, which import
    it inside the functions that need it (importing graphforge.distributed needs no torch)."""
    _, edges, _ = imports
    allowed = ("graphforge.torch", "graphforge.distributed")
    assert not [a for a, b, _ in edges if b == "torch" and not a.startswith(allowed)]
    assert not [a for a, b, inside in edges if b == "torch" and a.startswith("graphforge.distributed") and not inside]


#: what importing a layer's entry point alone must not bring in (besides the layers below it)
ALONE = {
    "graphforge.placement.cut": ("graphforge.passes", "graphforge.runtime", "graphforge.pass_manager", "torch"),
    "graphforge.program": ("graphforge.passes", "graphforge.runtime", "graphforge.pass_manager", "torch"),
    "graphforge.passes": ("graphforge.runtime", "graphforge.pass_manager", "graphforge.train", "torch"),
    "graphforge.distributed": ("graphforge.pass_manager", "graphforge.train", "torch"),
    "graphforge.runtime": (
        "graphforge.distributed",
        "graphforge.pass_manager",
        "graphforge.train",
        "graphforge.golden",
        "graphforge.diff",
        "torch",
    ),
}

_IMPORT_ALONE = """
import importlib, importlib.util, json, sys, types
spec = importlib.util.find_spec("graphforge")  # found, not run: its __init__ re-exports every layer
package = types.ModuleType("graphforge")
package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
sys.modules["graphforge"] = package
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("entry", sorted(ALONE))
def test_each_layer_imports_alone(entry):
    """In a fresh interpreter, importing a layer (without the package's re-exports) loads no
    module of a layer above it: the runtime check of what the static graph says."""
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALONE, entry], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert entry in loaded
    unwanted = [m for m in loaded if any(m == p or m.startswith(p + ".") for p in ALONE[entry])]
    assert not unwanted, f"importing {entry} alone loads {unwanted[:5]}"
