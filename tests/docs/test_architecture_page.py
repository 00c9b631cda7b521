"""The architecture page names exactly the package's folders (diagram and table), and so does the README."""

from __future__ import annotations

import re

from tests.docs._docs import DOCS, README, ROOT, fenced_blocks

PAGE = DOCS / "guide" / "architecture.md"
PACKAGE = ROOT / "src" / "miles_aio"


def folders() -> set[str]:
    return {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_the_diagram_has_one_box_per_folder() -> None:
    (diagram, _), *_ = fenced_blocks(PAGE.read_text(), "text")
    assert set(re.findall(r"\[(\w+)\]", diagram)) == folders()


def test_the_table_and_the_readme_layout_name_every_folder() -> None:
    table = set(re.findall(r"^\| `(\w+)/` \|", PAGE.read_text(), flags=re.M))
    runtime = folders() - {"models", "tasks", "testing"}  # named under the diagram, not runtime boxes
    assert table == runtime
    layout = README.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    missing = {f for f in folders() if not re.search(rf"\b{f}/", layout)}
    assert not missing, f"README's layout section does not name {sorted(missing)}"
