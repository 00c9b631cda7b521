"""The embedded engine's page lists exactly the /generate fields the engine refuses."""

from __future__ import annotations

import re

from miles_aio.engine import protocol
from tests.docs._docs import DOCS

PAGE = DOCS / "guide" / "embedded-engine.md"


def _refused_row(where: str) -> set[str]:
    text = PAGE.read_text(encoding="utf-8").split("Refused with a 400", 1)[1]
    row = re.search(rf"^\| {re.escape(where)} \| (.*) \|$", text, re.M)
    assert row, f"no '{where}' row in the refused-fields table of {PAGE.name}"
    return set(re.findall(r"`([a-z_]+)`", row.group(1)))


def test_the_refused_fields_table_is_the_engines_list() -> None:
    assert _refused_row("request") == set(protocol._GENERATE_DEFAULT_ONLY)
    assert _refused_row("`sampling_params`") == set(protocol._SAMPLING_DEFAULT_ONLY)
