"""Helpers of the docs tests: the doc pages, their code blocks and the metric names they mention."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
METRICS_PAGE = DOCS / "guide" / "metrics.md"
METRIC_PREFIXES = ("rollout/", "eval/", "perf/", "train/")
METRIC_RE = re.compile(r"(?:rollout|eval|perf|train)/[A-Za-z0-9_./{}<>*+-]*\Z")


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def fenced_blocks(text: str, lang: str) -> list[tuple[str, bool]]:
    """(code, runnable) of every ```lang block; runnable: preceded by a `<!-- runnable -->` line."""
    out = []
    pattern = re.compile(r"(<!-- runnable -->\n)?```" + re.escape(lang) + r"\n(.*?)\n```", re.S)
    for m in pattern.finditer(text):
        out.append((m.group(2), m.group(1) is not None))
    return out


def inline_code(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def template(name: str) -> str:
    """A metric name as a template: `{x}`, `<x>` and `*` placeholders all become `{}`."""
    name = re.sub(r"\{[^}]*\}|<[^>]*>", "{}", name)
    return name.replace("*", "{}")
