"""The training engine's modules form layers (docs/architecture.md, "Training engine"): a
module of `worker/engine/` imports only modules of the layers below its own, none of its own
layer and none above, so no two modules import each other, however indirectly. A new module
fails :func:`test_every_engine_module_has_one_layer` until it is given a place in `LAYERS`.

Every import counts: at the top of a module, inside a function (an import deferred to dodge
a cycle is still the cycle) and under ``if TYPE_CHECKING:`` (a type named across a cycle
ties the two modules as much as a call does). ``from worker.engine import x`` imports the
module ``x``; any other name from the package itself is an import of its ``__init__``.
A lower module that needs a higher one's object takes it as a value, or states the part it
uses as a protocol (``worker.engine.agreement.CheckedRun``, the part of
``worker.engine.run.Run`` the agreement checks read).

Imports by name (``importlib.import_module``, ``__import__``) count too: one whose name is
a constant is an import of that module; any other must be listed in `BY_NAME`, with the
modules it may import. There is one, the strategies' registry: defining a subclass of
``worker.engine.strategy.Strategy`` registers it (strategy.py is the bottom of the
strategies and imports none of them), and ``worker.engine.session.registered`` imports
every ``strategy_*`` module by name, so that a new strategy is one new module. That lookup
is in the session, the layer above every strategy (it runs their epochs), not in
strategy.py: so the import by name points down like every other import, and no exception
to the layers is needed.

The package's ``__init__`` runs before any of its modules, whichever is imported, so it may
import only modules of the bottom layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "worker" / "engine"
PACKAGE = "worker.engine"

LAYERS: list[set[str]] = [  # from the bottom
    # No engine imports: the spec, the event lines, the user's code, sample counts and
    # index helpers, preprocessing, speed emulation, the guard's cost model.
    # Tensors that may be sharded over a group; a rank's peak memory; the leaders' ring.
    {
        "contract",
        "emulation",
        "guard",
        "memory",
        "preprocess",
        "report",
        "ring",
        "sharded",
        "sharding",
        "spec",
    },
    # The process group, the split and its balancer, numerical faults, checkpoint files,
    # rank processes.
    {"balance", "checkpoint", "distributed", "numerics", "ranks", "split"},
    # Transfers between ranks, shard provenance, the strategies' interface and registry, the
    # model sharded over a group (FSDP2).
    {"exchange", "fsdp", "provenance", "reducer", "strategy"},
    # The data path; the model's state as flat vectors.
    {"data", "state"},
    # A worker's forward and backward; the parameter server's shards.
    {"compute", "shard_server"},
    # The cross-device checks; a plan's trial run.
    {"agreement", "trial"},
    # A rank's training state and its control points.
    {"run"},
    # The strategies (the others build on sync's step).
    {"strategy_sync"},
    {"strategy_periodic", "strategy_quorum", "strategy_diloco"},
    # The session around the strategies' epochs, then each role's side.
    {"session"},
    {"ps", "trainer"},
    # One rank's process, then a whole world on one host.
    {"launch"},
    {"prefork"},
    {"local"},
]

BY_NAME: dict[str, str] = {"session": "strategy_"}
"""Module -> the prefix of the engine modules it imports by a name it computes."""

BY_NAME_MARK = "<by name>"


def _modules() -> set[str]:
    return {path.stem for path in ENGINE.glob("*.py")}


def _target(dotted: str) -> str | None:
    """The engine module that importing ``dotted`` loads (None: not the engine's)."""
    if dotted == PACKAGE:
        return "__init__"
    if dotted.startswith(f"{PACKAGE}."):
        return dotted.split(".")[2]
    return None


def _from_targets(node: ast.ImportFrom, modules: set[str]) -> list[str | None]:
    base = node.module or ""
    if node.level == 1:  # relative to this package
        base = f"{PACKAGE}.{base}" if base else PACKAGE
    elif node.level:
        return []
    if base != PACKAGE:
        return [_target(base)]
    return [alias.name if alias.name in modules else "__init__" for alias in node.names]


def _by_name_target(node: ast.Call) -> str | None:
    """For an ``import_module(...)`` or ``__import__(...)`` call: the engine module a constant
    name loads, :data:`BY_NAME_MARK` for a computed name; None for any other call."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return _target(first.value)
    return BY_NAME_MARK


def engine_imports(source: str, modules: set[str]) -> list[tuple[int, str]]:
    """Every import of an engine module in ``source``, as ``(line, module)``, wherever it
    stands (top level, function, ``TYPE_CHECKING`` block), in line order; an import by a
    computed name is ``(line, BY_NAME_MARK)``."""
    found: list[tuple[int, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, _target(alias.name)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, target) for target in _from_targets(node, modules)]
        elif isinstance(node, ast.Call):
            found.append((node.lineno, _by_name_target(node)))
    return sorted((line, target) for line, target in found if target is not None)


def _imports_of(module: str) -> list[tuple[int, str]]:
    """``engine_imports`` of ``module``, an import by name as every module `BY_NAME` lets it
    load (left as ``BY_NAME_MARK`` when the module is not listed there)."""
    modules, prefix = _modules(), BY_NAME.get(module)
    expanded = []
    for line, target in engine_imports((ENGINE / f"{module}.py").read_text(), modules):
        if target == BY_NAME_MARK and prefix is not None:
            expanded += [(line, m) for m in sorted(modules) if m.startswith(prefix)]
        else:
            expanded.append((line, target))
    return expanded


def _layer_of() -> dict[str, int]:
    """Module -> its layer's number, from 1 at the bottom (as docs/architecture.md counts)."""
    return {module: number for number, layer in enumerate(LAYERS, 1) for module in layer}


def test_every_engine_module_has_one_layer() -> None:
    placed = [module for layer in LAYERS for module in layer]
    twice = sorted({module for module in placed if placed.count(module) > 1})
    assert twice == [], f"modules in two layers: {twice}"
    modules = _modules() - {"__init__"}
    assert sorted(modules - set(placed)) == [], "modules without a layer: place them in LAYERS"
    assert sorted(set(placed) - modules) == [], "LAYERS names modules worker/engine/ lacks"


def _offence(module: str, line: int, target: str, layer_of: dict[str, int]) -> str:
    where = f"worker/engine/{module}.py:{line} imports"
    if target == BY_NAME_MARK:
        return f"{where} a module by a computed name: list the modules it may load in BY_NAME"
    return (
        f"{where} worker.engine.{target} (layer {layer_of.get(target)}), "
        f"but {module} is in layer {layer_of[module]}"
    )


def test_each_engine_module_imports_only_the_layers_below_it() -> None:
    layer_of = _layer_of()
    wrong = [
        _offence(module, line, target, layer_of)
        for module in sorted(layer_of)
        for line, target in _imports_of(module)
        if layer_of.get(target, len(LAYERS) + 1) >= layer_of[module]
    ]
    assert wrong == [], "a module imports only from the layers below its own:\n" + "\n".join(wrong)


def test_the_package_init_imports_only_the_bottom_layer() -> None:
    assert {target for _, target in _imports_of("__init__")} <= LAYERS[0]


def test_deferred_type_only_and_by_name_imports_all_count() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from worker.engine import report, RunSpec\n"
        "if TYPE_CHECKING:\n"
        "    from worker.engine.run import Run\n"
        "def later(name):\n"
        "    import worker.engine.launch\n"
        "    from . import session\n"
        "    from .state import ModelState\n"
        "    importlib.import_module('worker.engine.trial')\n"
        "    importlib.import_module(name)\n"
        "    import torch\n"
    )
    assert engine_imports(source, {"report", "run", "launch", "session", "state", "trial"}) == [
        (2, "__init__"),
        (2, "report"),
        (4, "run"),
        (6, "launch"),
        (7, "session"),
        (8, "state"),
        (9, "trial"),
        (10, BY_NAME_MARK),
    ]
