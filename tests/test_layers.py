"""Layers only look down: every import inside relaympi/ points to a module of the same layer or of
a layer below it, and no imports close a circle.

The graph comes from the source (ast), not from running it: every ``import`` counts, at the top of a
module, inside a function (a lazy import is an arrow a reader follows the same way) and under
``if TYPE_CHECKING:``. A package whose ``__init__`` loads names lazily from a table of module names
(PEP 562 ``__getattr__``, a registry of "module:Class" strings) counts as importing those modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "relaympi"

# (layer, rank, modules): a module belongs to the entry with the longest matching name (the module
# itself or a package above it). An arrow may point to a lower rank, or within its own layer; two
# layers of one rank sit side by side and never import each other (algorithms and tasks).
LAYERS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    # what everything may use: the run file's schema (results), the launcher's environment, the
    # package version, where data sets live, the CLI's exit-status conventions
    (
        "foundation",
        0,
        (
            "relaympi",
            "relaympi.entrypoint",
            "relaympi.launcher",
            "relaympi.threads",
            "relaympi.provenance",
            "relaympi.results",
            "relaympi.costs",
            "relaympi.data",
            "relaympi.data.download",
            "relaympi.data.manifest",
            "relaympi.data.paths",
            "relaympi.registry",
        ),
    ),
    # pure graphs and schedules; the Communicator and its backends; the model's flat memory
    # layout (flat)
    ("topology, comm, flat layout", 1, ("relaympi.topology", "relaympi.comm", "relaympi.flat")),
    ("optim", 2, ("relaympi.optim",)),
    # each algorithm as message passing, its matrix form, and its vectorized (batched) form
    ("algorithms", 3, ("relaympi.algorithms", "relaympi.batched")),
    ("tasks", 3, ("relaympi.tasks",)),
    # the files a task reads, laid out and fetched (they name the tasks' formats)
    # exception: relaympi.data spans two layers, a store tasks use and a catalogue that asks tasks
    ("data sets", 4, ("relaympi.data.layouts", "relaympi.data.sets", "relaympi.data.imagenet")),
    # the run's configuration: its flags are checked against the registries below (topology,
    # algorithm, optimizer and task names) and its --help shows their defaults, so it sits
    # above them; nothing below imports it (a task takes its own options, an algorithm its own
    # options class)
    ("config", 5, ("relaympi.config",)),
    # the resolved plan, the one training loop, a worker's workload, evaluation, checkpoints (their
    # file format too), run file
    ("training", 6, ("relaympi.training",)),
    # what runs a plan: message passing over a Communicator (mpi, local) and the batched engine
    ("engines", 7, ("relaympi.engines",)),
    # command lines; a package's __main__ is its command's entry, in this layer, while the package
    # itself stays in its own
    (
        "commands",
        8,
        (
            "relaympi.train",
            "relaympi.commands",
            "relaympi.topology.__main__",
            "relaympi.data.__main__",
        ),
    ),
    # what reads the run files of many runs and may use everything below: the paper's tables
    ("report", 9, ("relaympi.report",)),
    # the paper's studies outside the training loop (random quadratics on the matrix engine)
    ("studies", 9, ("relaympi.studies",)),
)


def _modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under relaympi/: dotted name -> (file, is a package's __init__)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _owner(name: str, modules: dict) -> str | None:
    """The module that ``name`` (a module, or a name inside one) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _lazy_targets(tree: ast.Module, package: str) -> set[str]:
    """Modules a PEP 562 package or a registry loads by name: "relaympi.x.y:Class" strings, the
    argument of ``import_module("relaympi.x.y")``, and the short module names of a ``_HOME`` table
    (name -> submodule)."""
    targets = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("relaympi.")
            and ":" in node.value
        ):
            targets.add(node.value.partition(":")[0])
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        ):
            targets |= {
                a.value
                for a in node.args[:1]
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            }
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_HOME" for t in node.targets
        ):
            targets |= {
                f"{package}.{v.value}"
                for v in getattr(node.value, "values", [])
                if isinstance(v, ast.Constant) and isinstance(v.value, str)
            }
    return targets


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the relaympi modules it imports (anywhere in its source)."""
    modules = _modules(package)
    graph = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        home = name if is_package else name.rpartition(".")[0]
        targets = _lazy_targets(tree, home)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        [
                            *home.split(".")[: len(home.split(".")) - node.level + 1],
                            *([base] if base else []),
                        ]
                    )
                # `from pkg import submodule` imports the submodule; `from module import name`
                # the module
                targets |= {
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                }
        owners = {
            _owner(t, modules) for t in targets if t == "relaympi" or t.startswith("relaympi.")
        }
        graph[name] = {o for o in owners if o is not None and o != name}
    return graph


def layer_of(module: str) -> tuple[str, int] | None:
    best = None
    for layer, rank, names in LAYERS:
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(best[0])
            ):
                best = (prefix, layer, rank)
    return None if best is None else best[1:]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every arrow to a higher layer, or sideways to another layer of the same rank."""
    bad = []
    for source in sorted(graph):
        src = layer_of(source)
        for target in sorted(graph[source]):
            dst = layer_of(target)
            if src and dst and (dst[1] > src[1] or (dst[1] == src[1] and dst[0] != src[0])):
                bad.append(f"{source} ({src[0]}) -> {target} ({dst[0]})")
    return bad


def test_every_module_has_a_layer() -> None:
    missing = [m for m in sorted(import_graph()) if layer_of(m) is None]
    assert not missing, (
        "modules without a layer (add them to LAYERS in tests/test_layers.py):\n  "
        + "\n  ".join(missing)
    )


def test_no_import_runs_up_a_layer() -> None:
    bad = upward_arrows(import_graph())
    assert not bad, f"{len(bad)} import(s) run up or sideways:\n  " + "\n  ".join(bad)


def test_no_import_circles() -> None:
    graph = import_graph()
    circles = _circles(graph)
    lines = [
        " <-> ".join(c)
        + "\n    "
        + "\n    ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c)
        for c in circles
    ]
    assert not circles, f"{len(circles)} import circle(s):\n  " + "\n  ".join(lines)


def test_the_graph_sees_lazy_type_checking_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: each kind of import is an arrow, and a circle and an upward arrow are
    found."""
    pkg = tmp_path / "relaympi"
    (pkg / "tasks").mkdir(parents=True)
    (pkg / "training").mkdir()
    for init in (pkg, pkg / "tasks", pkg / "training"):
        (init / "__init__.py").write_text("")
    (pkg / "tasks" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from "
        "relaympi.training.plan import Plan\n"
        "def f():\n    from . import other\n"
    )
    (pkg / "tasks" / "other.py").write_text("X = 'relaympi.training.plan:Plan'\n")
    (pkg / "training" / "plan.py").write_text("import relaympi.tasks.base\n")
    graph = import_graph(pkg)
    assert graph["relaympi.tasks.base"] == {"relaympi.training.plan", "relaympi.tasks.other"}
    assert graph["relaympi.tasks.other"] == {"relaympi.training.plan"}
    assert graph["relaympi.training.plan"] == {"relaympi.tasks.base"}
    assert _circles(graph) == [
        ["relaympi.tasks.base", "relaympi.tasks.other", "relaympi.training.plan"]
    ]
    assert upward_arrows(graph) == [
        "relaympi.tasks.base (tasks) -> relaympi.training.plan (training)",
        "relaympi.tasks.other (tasks) -> relaympi.training.plan (training)",
    ]
