"""The layers import one way: a module imports only its own unit or a lower layer.

Leaves (the state tables, event types, host lists, the clock, errors, the worker-side
beacon) import nothing of ours. The composition roots (the daemon, the CLI) sit on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import trainpod

SRC = Path(trainpod.__file__).parent

# Lowest first. A unit is the longest prefix listed here that names the module.
LAYERS: list[set[str]] = [
    {
        "trainpod.model",
        "trainpod.clock",
        "trainpod.errors",
        "trainpod.slurm.hostlist",
        "trainpod.beacon",
        "trainpod.scheduler",
        "trainpod.procutil",
        "trainpod.notice",
        "trainpod.api.devices",
        "trainpod.resume",
        "trainpod.bounded",
        "trainpod.mtbf",
    },
    {"trainpod.paths"},
    {"trainpod.spec"},
    {
        "trainpod.api.models",
        "trainpod.api.params",
        "trainpod.store",
        "trainpod.ckpt",
        "trainpod.elastic",
    },
    {"trainpod.client", "trainpod.telemetry"},
    {"trainpod.agent", "trainpod.controller"},
    {"trainpod.dashboard"},
    {"trainpod.slurm", "trainpod.api"},
    {"trainpod.backends", "trainpod.testing"},
    {"trainpod.controller.daemon", "trainpod.cli", "trainpod", "trainpod.integrations"},
]
UNITS = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in UNITS:
            return prefix
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of trainpod in ``path`` (deferred ones included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "trainpod" or node.module.startswith("trainpod."):
                # ``from trainpod.api import models`` imports the module trainpod.api.models
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.append((node.lineno, sub if is_module(sub) else node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("trainpod.")]
    return out


def is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def test_no_module_imports_a_higher_or_sideways_layer() -> None:
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        me = unit_of(module_name(path))
        for line, target in imports(path):
            them = unit_of(target)
            if them != me and UNITS[them] >= UNITS[me]:
                rel = path.relative_to(SRC.parent)
                upward.append(
                    f"{rel}:{line}: {me} (layer {UNITS[me]}) imports {target} "
                    f"({them}, layer {UNITS[them]})"
                )
    assert not upward, "imports that go up or sideways:\n" + "\n".join(upward)


def test_every_module_is_in_a_layer() -> None:
    for path in SRC.rglob("*.py"):
        unit_of(module_name(path))
