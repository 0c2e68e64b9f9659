"""The layers docs/architecture.md draws in its layer table (LAYERS here; a test below holds
the two alike), checked on the import graph of the source itself, and by importing each layer
alone in a fresh interpreter.

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

#: The layers, lowest first, each in sub-layers, lowest first: a module may import modules of
#: its own sub-layer and of those below it, never one above. A name stands for a module and,
#: unless a longer name is listed, the package below it.
CORE = (
    # leaves: errors, temporary files, digests, the metadata keys, the op emitter, pipeline text,
    # tokenizer files
    (
        "graphforge.errors",
        "graphforge.tempfiles",
        "graphforge.digests",
        "graphforge.roles",
        "graphforge.builder",
        "graphforge.pass_spec",
        "graphforge.tokenizer_files",  # a tokenizer.json and the files beside it
    ),
    # ONNX protos and graphs as graphs, no file and no Model
    ("graphforge.ir", "graphforge.dag"),
    ("graphforge.ort_compat", "graphforge.payloads"),
    ("graphforge.stand_ins",),  # weights left out: of protos and of graphsurgeon's constants
    ("graphforge.constants",),
    ("graphforge.model_io",),  # files
    ("graphforge.graph",),  # the Model passes work on
    ("graphforge.shapes", "graphforge.verify", "graphforge.program", "graphforge.pass_infra"),
)
ANALYSIS = (  # read-only analyses of a model
    ("graphforge.analysis", "graphforge.analysis.size", "graphforge.analysis.dims", "graphforge.analysis.partition"),
    ("graphforge.analysis.host_sync", "graphforge.analysis.cost", "graphforge.analysis.memory"),
)
PLACEMENT = (  # where the parts of a program go; the step's cut, and its memory
    ("graphforge.placement", "graphforge.placement.cut", "graphforge.placement.lean", "graphforge.placement.precision"),
    ("graphforge.placement.buckets", "graphforge.placement.stages", "graphforge.placement.step"),
    ("graphforge.placement.step_memory",),
)
PASSES = (("graphforge.passes",),)
RUNTIME = (
    (
        "graphforge.runtime.sessions",
        "graphforge.runtime.checkpoint",
        "graphforge.runtime.dropout",
        "graphforge.runtime.inference",
        "graphforge.runtime.lr_schedules",
    ),
    ("graphforge.runtime.devices",),
    ("graphforge.runtime.dlpack", "graphforge.runtime.capture", "graphforge.runtime.runner"),
    # the update in torch's kernels, which Module picks; runs cut at the collectives a program marks
    ("graphforge.runtime.fused_update", "graphforge.runtime.chain"),
    ("graphforge.runtime.training",),  # Module: one client of the runner
    ("graphforge.runtime",),  # the package's re-exports
)
DISTRIBUTED = (  # the runtime's schedules over torch.distributed
    ("graphforge.distributed.world", "graphforge.distributed.schedules"),
    (
        "graphforge.distributed.simulate",
        "graphforge.distributed.data_parallel",
        "graphforge.distributed.tensor_parallel",
    ),
    ("graphforge.distributed.zero_data_parallel", "graphforge.distributed.stages"),
    ("graphforge.distributed",),
)
DRIVER = (("graphforge.pass_manager",),)
TOOLS = (
    ("graphforge.torch", "graphforge.diff", "graphforge.inspection"),
    # graphforge train, golden checks, on-device artifacts; generation over an inference model
    ("graphforge.train", "graphforge.golden", "graphforge.ondevice", "graphforge.generate"),
    ("graphforge.planning",),  # the planner: compiles candidates, reads the simulator, writes train configs
)
TOP = (("graphforge.cli", "graphforge.__main__", "graphforge"),)  # the CLI, and the package's public re-exports
LAYERS = {"core": CORE, "analysis": ANALYSIS, "placement": PLACEMENT, "passes": PASSES, "runtime": RUNTIME}
LAYERS |= {"distributed": DISTRIBUTED, "driver": DRIVER, "tools": TOOLS, "top": TOP}
#: every sub-layer in order, with the name of its layer: (layer, index within it, names)
ORDER = [(layer, i, names) for layer, subs in LAYERS.items() for i, names in enumerate(subs)]
#: The folders, lowest first, as the layers hold them: each package of graphforge/ (passes/ is
#: graphforge.passes), and graphforge/'s own files, which are the core, the driver and the top.
#: A folder may import only from itself and the folders before it.
FOLDERS = (
    "graphforge/ (the core's files)",
    "graphforge.analysis",
    "graphforge.placement",
    "graphforge.passes",
    "graphforge.runtime",
    "graphforge.distributed",
    "graphforge/ (the driver: pass_manager.py)",
    "graphforge.torch",
    "graphforge.diff",
    "graphforge.inspection",
    "graphforge.train",
    "graphforge.golden",
    "graphforge.ondevice",
    "graphforge.generate",
    "graphforge.planning",
    "graphforge/ (the top: cli.py, __main__.py, __init__.py)",
)

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


def _imports(modules: dict[str, Path], *, typing_only: bool = False):
    """(importer, imported module or library, inside a function?) for every import; with
    ``typing_only``, for the imports inside ``if TYPE_CHECKING:`` blocks instead."""
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        hidden, inside = _type_checking_only(tree), _in_functions(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if (id(node) in hidden) != typing_only or not isinstance(node, ast.Import | ast.ImportFrom):
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


@pytest.fixture(scope="module")
def annotations_too(imports):
    """The import graph with the imports made for annotations alone (``if TYPE_CHECKING:``)."""
    modules, _, graph = imports
    full = graph.copy()
    full.add_edges_from((a, b) for a, b, _ in _imports(modules, typing_only=True) if b in modules and a != b)
    return full


def _layer(module: str) -> int:
    """The position in ORDER of ``module``'s sub-layer: the longest listed name that is the
    module or a package above it."""
    best, found = -1, None
    for position, (_, _, names) in enumerate(ORDER):
        for name in names:
            if (module == name or (module.startswith(name + ".") and name != "graphforge")) and len(name) > best:
                best, found = len(name), position
    assert found is not None, f"{module} belongs to no layer: add it to LAYERS"
    return found


def _where(module: str) -> str:
    layer, index, _ = ORDER[_layer(module)]
    return f"{layer}[{index}]"


def test_every_module_is_in_a_layer(imports):
    modules, _, _ = imports
    for module in modules:
        _layer(module)


def _arrows_up(graph: nx.DiGraph) -> list[str]:
    """Every path by which a module reaches, directly or through others, a module of a higher
    sub-layer, written out with each module's sub-layer."""
    wrong = []
    for module in graph:
        for reached in nx.descendants(graph, module):
            if _layer(reached) > _layer(module):
                path = nx.shortest_path(graph, module, reached)
                wrong.append(" -> ".join(f"{m} ({_where(m)})" for m in path))
    return sorted(wrong)


def test_no_layer_reaches_a_layer_above_it(imports):
    """Directly or through others: passes never reach the runtime (nor the PassManager, the
    train loop, golden, diff or the CLI); the runtime never reaches train, golden or diff; and
    inside a layer no module reaches a sub-layer above its own (constants.py, say, may read the
    graph views of dag.py, never the cost model)."""
    _, _, graph = imports
    wrong = _arrows_up(graph)
    assert not wrong, "imports that reach a higher layer:\n" + "\n".join(wrong[:20])


def test_an_arrow_back_up_inside_the_core_is_caught():
    """The order is what the test holds: one arrow from a lower sub-layer to a higher one
    (dag.py importing the cost model) is reported with each path through it (constants.py,
    which reads dag.py, reaches the cost model too)."""
    graph = nx.DiGraph([("graphforge.constants", "graphforge.dag")])
    assert not _arrows_up(graph)
    graph.add_edge("graphforge.dag", "graphforge.analysis.cost")
    assert _arrows_up(graph) == [
        "graphforge.constants (core[4]) -> graphforge.dag (core[1]) -> graphforge.analysis.cost (analysis[1])",
        "graphforge.dag (core[1]) -> graphforge.analysis.cost (analysis[1])",
    ]


def _folder(module: str) -> str:
    """The entry of FOLDERS that holds ``module``."""
    parts = module.split(".")
    if module.startswith("graphforge.passes"):
        return "graphforge.passes"
    if len(parts) > 1 and (REPO / "graphforge" / parts[1]).is_dir():
        return ".".join(parts[:2])
    if module in DRIVER[0]:
        return FOLDERS[6]
    return FOLDERS[-1] if any(module in names for names in TOP) else FOLDERS[0]


def _arrows_up_by_folder(edges) -> list[str]:
    """Every import from a folder to one after it in FOLDERS."""
    rank = {folder: i for i, folder in enumerate(FOLDERS)}
    return sorted(
        f"{_folder(a)} -> {_folder(b)} ({a} imports {b})" for a, b in edges if rank[_folder(b)] > rank[_folder(a)]
    )


def test_no_folder_imports_a_folder_above_it(imports):
    """The import map drawn by folder: each folder reaches only itself and the folders before
    it in FOLDERS (the planner, a tool, reads the distributed simulator from above it; the
    analyses, below placement, reach neither placement nor the runtime)."""
    modules, _, graph = imports
    assert {_folder(m) for m in modules} <= set(FOLDERS), "a folder missing from FOLDERS"
    wrong = _arrows_up_by_folder(graph.edges)
    assert not wrong, "folders that import a folder above them:\n" + "\n".join(wrong[:20])


def test_folders_and_layers_agree(imports):
    """The map by folder and the map by module draw the same house: every module of a folder
    sits in a sub-layer at or below those of every later folder's modules, so a folder
    says which layer its files belong to."""
    modules, _, _ = imports
    held: dict[str, list[int]] = {}
    for module in modules:
        held.setdefault(_folder(module), []).append(_layer(module))
    present = [f for f in FOLDERS if f in held]
    wrong = [
        f"{low} reaches {ORDER[max(held[low])][0]}[{ORDER[max(held[low])][1]}], above {high}'s lowest module"
        for i, low in enumerate(present)
        for high in present[i + 1 :]
        if max(held[low]) > min(held[high])
    ]
    assert not wrong, "\n".join(wrong)


def test_an_arrow_back_up_between_folders_is_caught():
    """A module of a lower folder importing one of a higher folder (an analysis reading the
    distributed schedule simulator) is reported by folder; one importing a lower folder is not."""
    edges = [
        ("graphforge.analysis.cost", "graphforge.graph"),
        ("graphforge.analysis.timing", "graphforge.distributed.simulate"),
    ]
    assert _arrows_up_by_folder(edges) == [
        "graphforge.analysis -> graphforge.distributed (graphforge.analysis.timing imports graphforge.distributed.simulate)"
    ]


def test_no_import_cycles(annotations_too):
    """Not even through an import for annotations alone: a circle is two modules that each
    need the other to be read."""
    cycles = list(nx.simple_cycles(annotations_too))
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


#: where torch may be imported: the PyTorch front end anywhere; the distributed layer, the
#: torch <-> onnxruntime bridge and the update kernel inside the functions that need it
TORCH_ANYWHERE = ("graphforge.torch",)
TORCH_IN_FUNCTIONS = ("graphforge.distributed", "graphforge.runtime.dlpack", "graphforge.runtime.fused_update")


def test_torch_is_imported_nowhere_in_the_core(imports):
    """torch is an optional extra: importing graphforge, its runtime or its distributed layer
    needs no torch (each layer imported alone, below, checks the same at run time)."""
    _, edges, _ = imports
    torch_imports = [(a, inside) for a, b, inside in edges if b == "torch"]
    assert torch_imports, "no module imports torch: the test reads the imports wrong"
    wrong = [
        a
        for a, inside in torch_imports
        if not a.startswith(TORCH_ANYWHERE) and not (inside and a.startswith(TORCH_IN_FUNCTIONS))
    ]
    assert not wrong, f"torch imported where it may not be: {sorted(set(wrong))}"


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


#: compile MODEL and print which of torch and sympy that imported
_COMPILE = """
import sys, numpy as np, graphforge
from onnx import TensorProto, helper, numpy_helper
graphforge.compile(MODEL, PIPELINE)
print(sorted(m for m in sys.modules if m in ("torch", "sympy")))
"""
#: a model whose Reshape to [-1, 3] leaves ONNX's inference an unknown dim (unk__0), which
#: onnxruntime's symbolic shape inference works out (2·batch)
_RESHAPED = """helper.make_model(helper.make_graph(
    [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["y"])], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 2])],
    [numpy_helper.from_array(np.ones((3, 2), np.float32), "w"),
     numpy_helper.from_array(np.array([-1, 3], np.int64), "shape")]),
    opset_imports=[helper.make_opsetid("", 17)])"""


def test_compiling_a_program_imports_no_torch():
    """A compile whose shapes leave a dim unknown reaches onnxruntime's symbolic shape inference
    (autodiff relates the dims); importing it as onnxruntime.tools.symbolic_shape_infer would run
    that package's __init__, which imports torch (3-5 s of a 13-node model's compile): graphforge
    loads the file alone. A model whose every dim is known never starts it (nor sympy, 0.7 s)."""
    cases = (
        (_RESHAPED, "'loss(kind=mse, output=y), autodiff, adamw(lr=1e-2)'", "['sympy']"),
        ("'examples/digits/model.onnx'", "'loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2)'", "[]"),
    )
    for model, pipeline, expected in cases:
        code = _COMPILE.replace("MODEL", model).replace("PIPELINE", pipeline)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == expected


def test_a_module_imports_torch_at_its_first_update_not_before():
    """Module(update="auto") picks torch's fused kernel where it can, but imports torch (2 s)
    only when the first update runs: a Module made to evaluate or export never does."""
    code = (
        "import sys, numpy as np, graphforge\n"
        "program = graphforge.compile('examples/digits/model.onnx', "
        "'loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2)').model\n"
        "module = graphforge.Module(program, device='cpu')\n"
        "module.eval()\n"
        "module(np.zeros((2, 8, 8), np.uint8), np.zeros(2, np.int64))\n"
        "print('torch' in sys.modules)\n"
        "module.train()\n"
        "module.train_step(np.zeros((2, 8, 8), np.uint8), np.zeros(2, np.int64))\n"
        "print('torch' in sys.modules, module.update_note.split(' (')[0])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["False", "True update: torch._fused_adamw_"]


def _short(name: str) -> str:
    """A module or package of LAYERS as docs/architecture.md's layer table writes it."""
    if name == "graphforge":
        return "__init__"
    short = name.removeprefix("graphforge.").replace(".", "/")
    return short + "/" if (REPO / "graphforge" / short).is_dir() or short == "passes" else short


def layer_rows() -> dict[str, str]:
    """Each layer's sub-layers as the architecture's table lists them: modules of a sub-layer
    by commas, sub-layers lowest first by arrows."""
    return {
        layer: " → ".join(", ".join(f"`{_short(n)}`" for n in names) for names in subs)
        for layer, subs in LAYERS.items()
    }


def test_the_architecture_draws_the_layers_this_test_holds():
    """docs/architecture.md's layer table is this test's LAYERS, row by row, in order (when the
    layers change, the message gives the rows to write)."""
    text = (REPO / "docs" / "architecture.md").read_text().split("\n## Layers\n", 1)[-1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ") and line.count("|") >= 4]
    drawn = {cells[1].strip(): cells[3].strip() for cells in rows if cells[1].strip() in LAYERS}
    expected = layer_rows()
    assert list(drawn) == list(expected) and drawn == expected, (
        "write the layer table's third column as:\n"
        + "\n".join(f"| {layer} | ... | {row} | ... |" for layer, row in expected.items())
    )


#: test folders named otherwise than the tree's folder they test, and why
TEST_FOLDER_NAMES = {"torch_frontend": "graphforge/torch"}  # a tests/torch/ would shadow the torch package


def test_the_tests_mirror_the_tree():
    """Every folder of tests/ tests a folder of the tree at the same place: tests/X/ is
    graphforge/X/ or the top-level X/ (passes/, benchmarks/), tests/passes/autodiff/ is
    passes/autodiff/; graphforge/'s own modules are tested at tests/'s top."""
    tests = REPO / "tests"
    strays = []
    for folder in sorted(p for p in tests.rglob("*") if p.is_dir() and any(p.glob("test_*.py"))):
        parts = folder.relative_to(tests).parts
        first = TEST_FOLDER_NAMES.get(parts[0], parts[0])
        tested = [REPO / first / Path(*parts[1:]), REPO / "graphforge" / first / Path(*parts[1:])]
        if not any(t.is_dir() for t in tested):
            strays.append(folder.relative_to(REPO).as_posix())
    assert not strays, f"test folders with no folder of the tree to mirror: {strays}"
