"""The docs' diagrams name real classes and methods, and their runnable code samples run."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

from tests.docs._docs import ROOT, fenced_blocks, pages

SRC = ROOT / "src" / "miles_aio"
ARROW = r"(?:<<)?-{1,2}(?:>>|>|x|\))"
MESSAGE = re.compile(rf"^\s*(\w+)\s*{ARROW}\s*[+-]?\s*(\w+)\s*:\s*(.*)$")
PARTICIPANT = re.compile(r"^\s*(?:participant|actor)\s+(\w+)(?:\s+as\s+(.+?))?\s*$")


def class_modules() -> dict[str, list[str]]:
    """Class name → the miles_aio modules that define it (found by AST, imported when resolved)."""
    out: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(module)
    return out


def resolve_class(name: str, index: dict[str, list[str]]) -> type:
    modules = index.get(name)
    assert modules, f"no class {name!r} in miles_aio"
    cls = getattr(importlib.import_module(modules[0]), name)
    assert isinstance(cls, type), name
    return cls


def diagrams() -> list[tuple[str, str]]:
    return [
        (f"{p.relative_to(ROOT)}#{i}", code)
        for p in pages()
        for i, (code, _) in enumerate(fenced_blocks(p.read_text(encoding="utf-8"), "mermaid"))
    ]


def runnable_blocks() -> list[tuple[str, str]]:
    return [
        (f"{p.relative_to(ROOT)}#{i}", code)
        for p in pages()
        for i, (code, runnable) in enumerate(fenced_blocks(p.read_text(encoding="utf-8"), "python"))
        if runnable
    ]


def test_the_fully_async_page_has_the_buffer_diagram() -> None:
    names = [name for name, _ in diagrams()]
    assert any(n.startswith("docs/guide/fully-async.md") for n in names)


@pytest.mark.parametrize(("where", "code"), diagrams(), ids=[n for n, _ in diagrams()])
def test_diagrams_name_only_real_classes_and_methods(where: str, code: str) -> None:
    index = class_modules()
    lines = code.splitlines()
    assert lines[0].strip() == "sequenceDiagram", f"{where}: only sequence diagrams are checked"
    alias: dict[str, type] = {}
    boxed: list[str] = []
    in_box = False
    for line in lines[1:]:
        if line.strip().startswith("box "):
            in_box = True
        elif line.strip() == "end":
            in_box = False
        if m := PARTICIPANT.match(line):
            ident, label = m.group(1), (m.group(2) or m.group(1)).strip()
            alias[ident] = resolve_class(label, index)
            if in_box:
                boxed.append(label)
    calls = 0
    for line in lines:
        m = MESSAGE.match(line)
        if m is None:
            continue
        sender, receiver, text = m.groups()
        assert sender in alias and receiver in alias, f"{where}: undeclared participant in {line!r}"
        if call := re.match(r"(\w+)\(", text):
            calls += 1
            assert hasattr(alias[receiver], call.group(1)), (
                f"{where}: {alias[receiver].__name__} has no method {call.group(1)!r}"
            )
    assert calls, f"{where}: no method calls to check"
    if where.startswith("docs/guide/fully-async.md"):
        # the replacement point is visible: put() and get() cross into the box holding the buffer
        assert boxed == ["DefaultDataBuffer"]
        inside = {i for i, cls in alias.items() if cls.__name__ == "DefaultDataBuffer"}
        crossing = {
            re.match(r"\w+", m.group(3)).group(0)  # type: ignore[union-attr]
            for m in map(MESSAGE.match, lines)
            if m and m.group(2) in inside and m.group(1) not in inside
        }
        assert {"put", "get"} <= crossing


@pytest.mark.parametrize(("where", "code"), runnable_blocks(), ids=[n for n, _ in runnable_blocks()])
def test_runnable_code_samples_run(
    where: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), {"__name__": "__docs__"})


def test_there_are_runnable_samples() -> None:
    assert len(runnable_blocks()) >= 3
