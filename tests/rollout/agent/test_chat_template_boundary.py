"""The chat-template renderer is neutral ground: the engine and the controller's session server both use
it, it imports nothing of miles_aio, and the engine still imports nothing controller-side."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import miles_aio

pytestmark = pytest.mark.pure

SRC = Path(miles_aio.__file__).parent
# What the engine process may import of miles_aio besides itself: neutral modules only.
ENGINE_MAY_IMPORT = {
    "miles_aio.chat_template",
    "miles_aio.weight_broadcast",
    "miles_aio._aio",
    "miles_aio.logs",
    "miles_aio.__version__",
}


def miles_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "miles_aio":  # from miles_aio import x
            names |= {f"miles_aio.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("miles_aio"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("miles_aio")}
    return names


def test_the_engine_imports_only_neutral_modules() -> None:
    outside = {
        f"{path.name}: {name}"
        for path in (SRC / "engine").glob("*.py")
        for name in miles_imports(path)
        if not name.startswith("miles_aio.engine") and name not in ENGINE_MAY_IMPORT
    }
    assert not outside
    assert not (SRC / "engine" / "chat_template.py").exists()  # moved to miles_aio.chat_template
    assert any("miles_aio.chat_template" in miles_imports(p) for p in (SRC / "engine").glob("*.py"))


def test_chat_template_imports_nothing_of_miles_aio_and_the_session_server_uses_it() -> None:
    assert miles_imports(SRC / "chat_template.py") == set()
    assert "miles_aio.chat_template" in miles_imports(SRC / "rollout" / "agent" / "server.py")


def test_the_trainer_does_not_import_the_engine_and_the_client_side_only_its_cli() -> None:
    """The engine is a program of its own: the trainer reaches it only through the neutral broadcast
    protocol, the launchers only through its command line (`miles_aio.engine.cli`, no torch)."""
    trainer = {
        f"{path.name}: {name}"
        for path in (SRC / "trainer").glob("*.py")
        for name in miles_imports(path)
        if name.startswith("miles_aio.engine")
    }
    assert not trainer
    client_side = {
        name
        for path in (SRC / "inference").glob("*.py")
        for name in miles_imports(path)
        if name.startswith("miles_aio.engine")
    }
    assert client_side <= {"miles_aio.engine.cli"}
    assert any("miles_aio.weight_broadcast" in miles_imports(p) for p in (SRC / "trainer").glob("*.py"))
