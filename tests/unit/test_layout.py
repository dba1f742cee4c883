"""The package's rooms keep to themselves: no import circle, and no room imports one it must never know (DESIGN's
"never" column). Read from the source, every import counted, those inside functions too."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ONLY: dict[str, set[str]] = {
    "errors": set(),
    "redaction": set(),
    "atomic": set(),
    "hardware": {"errors"},
    "config": {"errors"},
    "batch": {"errors", "config"},
    "precision": {"config"},
    "checkpoint.layout": {"errors", "atomic", "runs.layout"},
    "runs.layout": set(),
}
"""The lowest rooms, and the only rooms each of them imports."""
NEVER: dict[str, set[str]] = {
    "dist": {"model", "data", "parallel", "plan", "estimate", "train", "checkpoint", "runs.status", "metrics"},
    "data": {"model", "parallel", "plan", "estimate", "train", "checkpoint", "metrics", "diloco"},
    "model": {"parallel", "plan", "estimate", "train", "checkpoint", "diloco", "metrics", "dist"},
    "estimate": {"dist", "parallel", "plan", "train", "checkpoint", "metrics", "diloco", "runs"},
    "parallel": {"plan", "estimate", "train", "checkpoint", "metrics", "diloco", "runs"},
    "runs.status": {"dist", "model", "parallel", "plan", "estimate", "train", "checkpoint", "metrics", "data"},
    "runs.report": {"dist", "model", "parallel", "plan", "estimate", "train", "checkpoint", "metrics"},
    "runs.diagnose": {"dist", "model", "parallel", "plan", "estimate", "train", "checkpoint", "metrics"},
    "plan": {"train", "cli", "launch"},
    "launch": {"train", "model", "data", "parallel", "plan", "checkpoint", "metrics", "diloco", "dist"},
    "doctor": {"model", "data", "parallel", "plan", "estimate", "train", "checkpoint", "metrics", "diloco"},
    "checkpoint.save": {"train", "plan", "estimate"},
    "diloco": {"data", "model", "plan", "estimate", "train", "checkpoint", "metrics", "launch"},
}
"""Room -> rooms it never imports, by dotted name under trainyard."""
TORCH_DISTRIBUTED_FREE = ("estimate", "runs.status", "runs.report", "runs.diagnose", "runs.layout", "config",
                          "config_file", "hardware", "batch")


@functools.cache
def modules() -> dict[str, ast.Module]:
    """Every module of the package, parsed once for all the tests (~1 s of CPU a parse; no test changes it)."""
    found = {}
    for path in (SRC / "trainyard").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        found[name] = ast.parse(path.read_text())
    return found


def imported(tree: ast.Module, known: set[str] | None = None) -> set[str]:
    """Every module an import names (absolute), anywhere in the file: `from pkg import sub` names pkg.sub when it
    is a module, else pkg."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            modules_named = subs & (known or set())
            names.update(modules_named)
            if len(modules_named) < len(subs):
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@functools.cache
def trainyard_edges() -> dict[str, set[str]]:
    found = modules()
    edges = {}
    for name, tree in found.items():
        if name == "trainyard":
            continue
        targets = set()
        for target in imported(tree, set(found)):
            while target and target not in found:
                target = target.rpartition(".")[0]
            if target and target not in (name, "trainyard"):
                targets.add(target)
        edges[name] = targets
    return edges


def room(module: str) -> str:
    """trainyard.model.lora -> model; trainyard.checkpoint.save -> checkpoint.save, trainyard.runs.layout ->
    runs.layout (these packages hold rooms of different heights: save/layout below the loop, export/evaluate
    above; the run dir's names below every room that writes one)."""
    parts = module.split(".")[1:]
    return ".".join(parts[:2]) if parts[0] in ("checkpoint", "runs") and len(parts) > 1 else parts[0]


def test_the_tables_name_rooms_that_exist() -> None:
    """A room renamed or moved into a package must be renamed here too, or its rules would check nothing."""
    rooms = {room(name) for name in modules() if name != "trainyard"}
    named = {*ONLY, *NEVER, *TORCH_DISTRIBUTED_FREE}.union(*ONLY.values(), *NEVER.values())
    assert named <= rooms, sorted(named - rooms)


def test_no_import_circle() -> None:
    edges = trainyard_edges()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            assert state.get(nxt) != 1, "import circle: " + " -> ".join([*path[path.index(nxt):], nxt])
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])


def _imports_of(owner: str) -> list[tuple[str, str]]:
    return [(module, target) for module, targets in trainyard_edges().items() if room(module) == owner
            for target in targets if room(target) != owner]


@pytest.mark.parametrize("owner", sorted(ONLY))
def test_the_lowest_rooms_import_only_what_is_below_them(owner: str) -> None:
    wrong = sorted(f"{module} imports {target}" for module, target in _imports_of(owner)
                   if room(target) not in ONLY[owner])
    assert not wrong, wrong


@pytest.mark.parametrize("owner", sorted(NEVER))
def test_a_room_never_imports_what_it_must_not_know(owner: str) -> None:
    wrong = sorted(f"{module} imports {target}" for module, target in _imports_of(owner)
                   if room(target) in NEVER[owner])
    assert not wrong, wrong


@pytest.mark.parametrize("owner", TORCH_DISTRIBUTED_FREE)
def test_planning_rooms_never_import_torch_distributed(owner: str) -> None:
    wrong = sorted(
        name for name, tree in modules().items() if name != "trainyard" and room(name) == owner
        for target in imported(tree) if target.startswith("torch.distributed")
    )
    assert not wrong, wrong


def test_nothing_but_the_cli_imports_training_or_the_cli() -> None:
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in trainyard_edges().items()
        for target in targets
        if room(target) in ("train", "cli") and room(module) not in ("train", "cli", "checkpoint.evaluate")
    )
    assert not wrong, wrong
