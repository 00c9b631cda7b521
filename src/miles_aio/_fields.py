"""Config field helpers shared by every component's config dataclass (kept apart to avoid import cycles)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigWarning", "flag", "opt"]


def opt(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    shown_default: str | None = None,
) -> Any:
    """A config field whose CLI help (and metavar) live in its metadata.

    `help` never states the default: `--help` appends "(default: X)" once, X being the recipe's value
    or the field's own default, shown as `shown_default` when given (a derived default, e.g.
    "--rollout-temperature"). `parse` turns the flag's text into the value (raising ValueError)."""
    metadata = {"help": help, "metavar": metavar, "parse": parse, "shown_default": shown_default}
    if default is dataclasses.MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


def flag(name: str) -> str:
    """The command-line flag of a config field: `max_weight_staleness` → `--max-weight-staleness`."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True, slots=True)
class ConfigWarning:
    """A valid but risky setting, found by `miles_aio.config.config_warnings` and logged once, by the
    controller process (validation itself never logs)."""

    event: str
    detail: str
    flags: Sequence[str] = ()

    def __str__(self) -> str:
        return f"{', '.join(self.flags)}: {self.detail}" if self.flags else self.detail
