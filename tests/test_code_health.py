"""The shape of the code, checked with ``ast``: no import circle between modules or between
packages, short functions, short files, and the layers import downwards only
(``docs/architecture.md`` draws them).

Every ``import`` counts, also those inside functions (a function-level import hides a circle
from Python's import machinery, not from a reader), and so do ``importlib.import_module("...")``
calls with a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sysx"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600
# The job layer: the command lines, the trainers, the pre-flight and the run directory.
JOB_LAYER = (
    "sysx.train",
    "sysx.trainers",
    "sysx.cli",
    "sysx.preflight",
    "sysx.run_dir",
    "sysx.plan_command",
    "sysx.plan_replicas",
    "sysx.plan_nvme",
    "sysx.sweep",
    "sysx.generate",
)
# The planner sits above the engines it plans for.
PLANNER = ("sysx.autotune",)
# Everything a job is built from; none imports the job layer, and none but the planner imports the planner.
ENGINES = (
    "sysx.autotune",
    "sysx.emulate",
    "sysx.trace",
    "sysx.checkpoint",
    "sysx.memory",
    "sysx.optim",
    "sysx.runtime",
    "sysx.single",
    "sysx.schedule",
    "sysx.model",
    "sysx.data",
    "sysx.config",
    "sysx.machine",
    "sysx.partition",
    "sysx.replicas",
    "sysx.device",
    "sysx.device_memory",
    "sysx.dist",
    "sysx.device_binding",
    "sysx.peers",
    "sysx.rendezvous",
    "sysx.stopping",
    "sysx.faults",
    "sysx.cachedir",
    "sysx.metrics",
    "sysx.tracking",
)
# What the configuration may import besides itself: the model presets and shapes.
CONFIG_MAY_IMPORT = ("sysx.config", "sysx.model")
# The launchers (torchrun / mpirun wrappers) stand beside the job: they start it and import little.
LAUNCHERS = ("sysx.launch", "sysx.rank_env")
# Imported inside the functions that use them, never when a sysx module is imported: each costs 0.3-3 s
# at the start of every process (every rank, pre-flight and command), used or not.
# torch.nn.attention.bias imports torch._dynamo: 0.8 s of each launch script's pre-flight.
IMPORTED_WHERE_USED = (
    "torch._dynamo",
    "torch.nn.attention",
    "torch.distributed.pipelining",
    "torch.utils.tensorboard",
    "deepspeed",
    "transformers",
    "datasets",
    "matplotlib",
    "tensorboard",
    "wandb",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imported_names(tree: ast.AST, name: str, is_package: bool) -> Iterator[str]:
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)  # ``from pkg import submodule``
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value


def import_graph() -> dict[str, set[str]]:
    """Module -> the sysx modules it imports anywhere in its body."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for imported in _imported_names(tree, name, path.name == "__init__.py"):
            if imported in mods and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _without_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package ``__init__`` re-exports are a facade, not a dependency of the package's own modules:
    ``sysx.memory`` importing ``sysx.memory.segment`` and ``segment`` importing ``sysx.memory.names``
    is no circle, so edges *into* a package's ``__init__`` from its own submodules are dropped."""
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    out = {}
    for v, targets in graph.items():
        out[v] = {w for w in targets if not (w in packages and v.startswith(w + "."))}
    return out


def test_no_import_circle_anywhere_in_sysx() -> None:
    cycles = find_cycles(_without_packages(import_graph()))
    assert not cycles, "import circles (function-level imports count): " + "; ".join(" <-> ".join(c) for c in cycles)


def package_of(module: str) -> str:
    """``sysx.runtime.lanes`` -> ``sysx.runtime``; top-level modules (``sysx.device``) stay themselves."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to top-level packages (edges within a package dropped)."""
    out: dict[str, set[str]] = {}
    for v, targets in graph.items():
        pv = package_of(v)
        out.setdefault(pv, set()).update(pw for pw in map(package_of, targets) if pw != pv)
    return out


def _in(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def imports_between(graph: dict[str, set[str]], sources: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    """``module -> imported`` for every import from a module of ``sources`` into one of ``targets``."""
    return [f"{v} -> {w}" for v in sorted(graph) if _in(v, sources) for w in sorted(graph[v]) if _in(w, targets)]


def test_no_import_circle_between_packages() -> None:
    cycles = find_cycles(package_graph(import_graph()))
    assert not cycles, "package circles (sysx.a.x imports sysx.b.y and back): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_every_module_has_a_layer() -> None:
    """A new package or top-level module is placed in a layer here (and in docs/architecture.md)."""
    unplaced = [m for m in modules() if m != "sysx" and not _in(m, JOB_LAYER + ENGINES + LAUNCHERS)]
    assert not unplaced, "modules in no layer: " + ", ".join(unplaced)


def test_engines_do_not_import_the_job_layer() -> None:
    bad = imports_between(import_graph(), ENGINES, JOB_LAYER)
    assert not bad, "engines import the job layer: " + ", ".join(bad)


def test_only_the_job_layer_imports_the_planner() -> None:
    graph = import_graph()
    below = tuple(e for e in ENGINES if e not in PLANNER)
    bad = imports_between(graph, below + LAUNCHERS, PLANNER)
    assert not bad, "the planner (autotune) is imported from below it: " + ", ".join(bad)


def test_config_imports_only_the_model_presets() -> None:
    """Config checks values: it reads the model presets and opens no files of other layers (the
    single-GPU engine, checkpoints; ``model.init_from`` is read by ``sysx.checkpoint.pretrained``)."""
    graph = import_graph()
    bad = [
        f"{v} -> {w}"
        for v in graph
        if _in(v, ("sysx.config",))
        for w in sorted(graph[v])
        if not _in(w, CONFIG_MAY_IMPORT)
    ]
    assert not bad, "config imports beyond the model presets: " + ", ".join(bad)


def module_level_imports(tree: ast.Module) -> list[str]:
    """The absolute names a module imports when it is imported: its statements outside functions
    (class bodies, ``if`` and ``try`` blocks included), ``if TYPE_CHECKING:`` blocks left out."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.extend([node.module] if node.module and not node.level else [])
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def test_heavy_libraries_are_imported_where_used() -> None:
    bad = [
        f"{name} imports {imported}"
        for name, path in modules().items()
        for imported in module_level_imports(ast.parse(path.read_text()))
        if _in(imported, IMPORTED_WHERE_USED)
    ]
    assert not bad, "import these inside the functions that use them: " + ", ".join(bad)


def long_functions() -> list[tuple[int, str]]:
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    found.append((lines, f"{name}.{node.name} (line {node.lineno})"))
    return sorted(found, reverse=True)


def test_no_function_over_the_limit() -> None:
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(f"{w}: {n}" for n, w in found)


def test_no_file_over_the_limit() -> None:
    found = sorted(((len(p.read_text().splitlines()), n) for n, p in modules().items()), reverse=True)
    over = [f"{n}: {lines}" for lines, n in found if lines > MAX_FILE_LINES]
    assert not over, f"files over {MAX_FILE_LINES} lines: " + ", ".join(over)


# The checks themselves must be able to fail.
def test_the_cycle_finder_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_a_planted_package_circle_is_caught() -> None:
    """Two packages whose modules import each other form a circle even though no module circle exists."""
    graph = {
        "sysx.a.x": {"sysx.b.y"},
        "sysx.b.y": set(),
        "sysx.b.z": {"sysx.a.w"},
        "sysx.a.w": set(),
        "sysx.c": {"sysx.a.x"},
    }
    assert find_cycles(_without_packages(graph)) == []  # no module circle
    assert package_graph(graph) == {"sysx.a": {"sysx.b"}, "sysx.b": {"sysx.a"}, "sysx.c": {"sysx.a"}}
    assert find_cycles(package_graph(graph)) == [["sysx.a", "sysx.b"]]
    assert imports_between(graph, ("sysx.b",), ("sysx.a",)) == ["sysx.b.z -> sysx.a.w"]


def test_function_level_and_importlib_imports_are_seen(tmp_path: Path) -> None:
    src = "def f():\n    from sysx.memory import budget\n    import importlib\n    importlib.import_module('sysx.train')\n"
    names = set(_imported_names(ast.parse(src), "sysx.x", False))
    assert {"sysx.memory", "sysx.memory.budget", "sysx.train"} <= names


def test_module_level_imports_are_told_from_function_level_ones() -> None:
    src = (
        "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import wandb\n"
        "try:\n    from torch.nn.attention.bias import causal_lower_right\nexcept ImportError:\n    pass\n"
        "class A:\n    import matplotlib\n    def f(self):\n        import transformers\n"
        "def g():\n    import datasets\n"
    )
    assert module_level_imports(ast.parse(src)) == ["os", "typing", "torch.nn.attention.bias", "matplotlib"]


@pytest.mark.parametrize("level,module,expected", [(1, "ops", "sysx.schedule.ops"), (2, "device", "sysx.device")])
def test_relative_imports_resolve(level: int, module: str, expected: str) -> None:
    tree = ast.Module(body=[ast.ImportFrom(module=module, names=[ast.alias(name="x")], level=level)], type_ignores=[])
    assert expected in set(_imported_names(tree, "sysx.schedule.lower", False))
