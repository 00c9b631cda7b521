"""The command line, generated from the config dataclasses (miles' flag names).

`build_parser()` adds one argument group per component; every flag comes from a config field, with
its help and default. `parse_run_config()` builds the frozen `RunConfig`; anything invalid — a bad
value, a bad combination, an unresolvable plug-in — exits with code 2 and a message naming the flags,
before any process starts. Recipes pass their own defaults; every flag still overrides them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args, get_origin

from miles_aio.config import (
    BufferConfig,
    DataConfig,
    DriverConfig,
    EngineConfig,
    EvalConfig,
    ObservabilityConfig,
    RolloutConfig,
    RunConfig,
    SchedulerConfig,
    TrainConfig,
    flag,
)
from miles_aio.errors import ConfigError

__all__ = ["COMPONENTS", "build_parser", "config_error_exit", "parse_run_config"]

# (RunConfig attribute, component class, argument group title)
COMPONENTS: list[tuple[str, type[Any], str]] = [
    ("data", DataConfig, "data"),
    ("rollout", RolloutConfig, "rollout"),
    ("scheduler", SchedulerConfig, "submission scheduler"),
    ("buffer", BufferConfig, "data buffer"),
    ("driver", DriverConfig, "driver step loop"),
    ("eval", EvalConfig, "evaluation"),
    ("engine", EngineConfig, "inference engines"),
    ("train", TrainConfig, "trainer"),
    ("observability", ObservabilityConfig, "observability"),
]


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field[Any], hint: Any, default: Any) -> None:
    name = flag(f.name)
    help_text = f.metadata.get("help", "")
    kwargs: dict[str, Any] = {"dest": f.name, "help": help_text}
    if f.metadata.get("metavar"):
        kwargs["metavar"] = f.metadata["metavar"]
    origin, args = get_origin(hint), get_args(hint)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    required = default is dataclasses.MISSING
    if required:
        kwargs["required"] = True
    else:
        kwargs["default"] = default
        kwargs["help"] = f"{help_text} (default: {_show(default)})"
    if base is bool:
        group.add_argument(name, action=argparse.BooleanOptionalAction, **kwargs)
        return
    if get_origin(base) is Literal:
        kwargs["choices"] = list(get_args(base))
        kwargs["type"] = str
    elif get_origin(base) is tuple:
        kwargs["nargs"] = "*"
        kwargs["type"] = get_args(base)[0]
    elif base in (int, float, str, Path):
        kwargs["type"] = base
    else:
        raise TypeError(f"no CLI mapping for field {f.name}: {hint!r}")
    group.add_argument(name, **kwargs)


def _show(value: Any) -> str:
    if value is None:
        return "off"
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "none"
    return str(value)


def build_parser(
    prog: str | None = None, *, description: str | None = None, defaults: Mapping[str, Any] | None = None
) -> argparse.ArgumentParser:
    """A parser for every RunConfig flag. `defaults` (by field name) override the dataclass defaults."""
    defaults = dict(defaults or {})
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=defaults.pop("run_dir", None),
        help="Directory for everything the run writes (default: runs/<recipe>-<timestamp>).",
    )
    for _, cls, title in COMPONENTS:
        group = parser.add_argument_group(title)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = defaults.pop(f.name, f.default)
            _add_field(group, f, hints[f.name], default)
    if defaults:
        raise TypeError(f"unknown recipe defaults: {sorted(defaults)}")
    return parser


def config_from_namespace(ns: argparse.Namespace, *, run_dir: Path) -> RunConfig:
    """Build RunConfig from parsed args (raises ConfigError)."""
    values = vars(ns)
    parts: dict[str, Any] = {}
    for attr, cls, _ in COMPONENTS:
        kwargs = {f.name: values[f.name] for f in dataclasses.fields(cls)}
        for k, v in kwargs.items():
            if isinstance(v, list):
                kwargs[k] = tuple(v)
        parts[attr] = cls(**kwargs)
    return RunConfig(run_dir=run_dir, **parts)


def config_error_exit(parser: argparse.ArgumentParser, err: ConfigError) -> NoReturn:
    sys.stderr.write(f"{parser.prog}: error: {err}\n(run `{parser.prog} --help` for every flag)\n")
    raise SystemExit(2)


def parse_run_config(
    argv: Sequence[str] | None,
    *,
    prog: str | None = None,
    defaults: Mapping[str, Any] | None = None,
    default_run_dir: Path | None = None,
) -> RunConfig:
    """Parse flags into a validated RunConfig, or exit 2 naming the offending flags."""
    parser = build_parser(prog, defaults=defaults)
    ns = parser.parse_args(argv)
    run_dir = ns.run_dir or default_run_dir or Path("runs/run")
    try:
        return config_from_namespace(ns, run_dir=run_dir)
    except ConfigError as e:
        config_error_exit(parser, e)
