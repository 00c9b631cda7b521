"""Per-token weight versions on the wire, server side: SGLang's `meta_info.weight_versions` spans.

The one encoder of the servers that answer SGLang's `/generate`: the embedded engine (`handlers`,
`openai`) and the SGLang stub (`miles_aio.testing.sglang_stub_server`), which is why it imports nothing
(no torch). The client reads the spans back in `miles_aio.inference.wire`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["version_spans"]


def version_spans(versions: Sequence[str], *, current: str) -> list[dict[str, Any]]:
    """Per-token versions → SGLang's `weight_versions`: `[{version, start, end}]`, end exclusive, covering
    every output token; a request with no output gets one empty span at the current version."""
    if not versions:
        return [{"version": current, "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans
