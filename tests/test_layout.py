"""The runtime's rooms import one way only: serving -> decoding -> engines (runtime/__init__.py says who owns what).

A module that reaches upward (an engine importing the loop, the loop importing the server) would tie the rooms
into one again; this test reads every import statement, lazy ones inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # the fast tier: pure functions on small inputs, no model

RUNTIME = Path(__file__).resolve().parent.parent / "runtime"
ORDER = ["engines", "decoding", "serving"]  # each room may import the rooms before it


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else f"spectrt.runtime.{path.parent.name}.{node.module}"
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("room", ORDER)
def test_rooms_import_only_the_rooms_below_them(room):
    forbidden = {f"spectrt.runtime.{above}" for above in ORDER[ORDER.index(room) + 1:]}
    files = sorted((RUNTIME / room).glob("*.py"))
    assert files, f"runtime/{room}/ has no modules"
    upward = {f"{path.relative_to(RUNTIME.parent)}: {name}" for path in files for name in _imports(path)
              if any(name == f or name.startswith(f + ".") for f in forbidden)}
    assert not upward, f"runtime/{room} imports a room above it: {sorted(upward)}"


def test_the_runtime_imports_nothing_offline():
    """runtime/ is what a deployment runs: it may not reach into the offline packages (build/, quant/) or the CLI,
    which import it (the model resolver and an engines folder's reader live in runtime/engines/)."""
    offline = ("spectrt.build", "spectrt.quant", "spectrt.cli")
    reaching = sorted(f"{path.relative_to(RUNTIME.parent)}: {name}" for path in sorted(RUNTIME.rglob("*.py"))
                      for name in _imports(path) if any(name == o or name.startswith(o + ".") for o in offline))
    assert not reaching, f"runtime/ imports offline code: {reaching}"


def test_every_runtime_module_lives_in_a_room():
    loose = sorted(p.name for p in RUNTIME.glob("*.py") if p.name not in ("__init__.py", "resources.py"))
    assert not loose, f"modules outside the rooms: {loose} (move them into engines/, decoding/ or serving/)"


def test_flags_are_parsed_only_in_the_cli():
    """Libraries take plain values: argparse lives in cli/ (the `spectrt` command and its developer entry points)
    and in scripts/ (benchmark tools), never in build/, quant/ or runtime/."""
    root = RUNTIME.parent
    libraries = [p for room in ("build", "quant", "runtime") for p in sorted((root / room).rglob("*.py"))]
    parsing = sorted(str(p.relative_to(root)) for p in libraries if "argparse" in _imports(p))
    assert not parsing, f"argparse outside cli/: {parsing} (move the flags into cli/, pass plain values)"
