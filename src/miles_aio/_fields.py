"""Config field helpers shared by every component's config dataclass (kept apart to avoid import cycles)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

__all__ = ["flag", "opt"]


def opt(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    metavar: str | None = None,
) -> Any:
    """A config field whose CLI help (and metavar) live in its metadata."""
    metadata = {"help": help, "metavar": metavar}
    if default is dataclasses.MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


def flag(name: str) -> str:
    """The command-line flag of a config field: `max_weight_staleness` → `--max-weight-staleness`."""
    return "--" + name.replace("_", "-")
