"""The command line, generated from the config dataclasses (miles' flag names).

One typed path from flags to components:

    argv ──parse_flags──▶ ParsedFlags (every value, and which flags the command line set)
         ──config_from_values──▶ RunConfig (validated: pure checks)
         ──miles_aio.config.resolve──▶ RunConfig (derived fields filled in, once)

`build_parser()` adds one argument group per component; every flag comes from a config field, with
its help, its default (stated once, by `--help`) and, where a field has one, its parser. Anything
invalid — a bad value, a bad combination, an unresolvable plug-in — exits with code 2 and a message
naming the flags, before any process starts; an argparse error (an unknown flag, a bad number) prints
one usage line, the error and, for an unknown flag, the closest real one. Recipes pass their own
defaults (`defaults`), and defaults that hold only while other flags have given values
(`DefaultsWhen`); every flag the command line sets overrides both.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, get_args, get_origin

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
    resolve,
)
from miles_aio.errors import ConfigError

__all__ = [
    "COMPONENTS",
    "DefaultsWhen",
    "FlagParser",
    "ParsedFlags",
    "add_flags",
    "apply_defaults_when",
    "build_parser",
    "component_from_values",
    "config_error_exit",
    "config_from_values",
    "defaults_when_notes",
    "parse_flags",
    "parse_run_config",
    "shown_default",
]

T = TypeVar("T")

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


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are short: one usage line (not every flag), the error, and for
    an unknown flag the closest real one ("did you mean --x?"); exit code 2."""

    def error(self, message: str) -> NoReturn:
        lines = [f"usage: {self.prog} [FLAGS]  (`{self.prog} --help` lists every flag)"]
        lines.append(f"{self.prog}: error: {message}")
        lines += self.suggestions(message)
        sys.stderr.write("\n".join(lines) + "\n")
        raise SystemExit(2)

    def suggestions(self, message: str) -> list[str]:
        """'did you mean --x?' for each unknown `--flag` of an "unrecognized arguments" message."""
        if not message.startswith("unrecognized arguments:"):
            return []
        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        unknown = [w.split("=", 1)[0] for w in message.split(":", 1)[1].split() if w.startswith("--")]
        out = []
        for arg in unknown:
            prefixed = [k for k in known if k.startswith(arg)]  # a flag cut short: `--rollout-temp`
            match = difflib.get_close_matches(arg, prefixed or known, n=1, cutoff=0.0 if prefixed else 0.6)
            if match:
                out.append(
                    f"did you mean {match[0]}?" if len(unknown) == 1 else f"{arg}: did you mean {match[0]}?"
                )
        return out


@dataclass(frozen=True, slots=True)
class DefaultsWhen:
    """Recipe defaults that hold only while other flags have the given values, e.g. a
    tensor-parallel size for `--train-backend megatron` that an FSDP run must not inherit. They never
    override a flag the command line sets."""

    when: Mapping[str, Any]
    defaults: Mapping[str, Any]

    def holds(self, values: Mapping[str, Any]) -> bool:
        return all(values.get(k) == v for k, v in self.when.items())

    def describe(self) -> str:
        return "with " + ", ".join(f"{flag(k)} {_show(v)}" for k, v in self.when.items())


@dataclass(frozen=True, slots=True)
class ParsedFlags:
    """What the command line says: every dest's value (the command line's, else the parser's default)
    and the dests the command line set itself."""

    values: dict[str, Any]
    given: frozenset[str]
    unknown: tuple[str, ...] = ()


def _converter(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:  # argparse would say "invalid convert value"; say what is wrong
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def shown_default(action: argparse.Action) -> str:
    """How `--help` (and the flag reference) shows an action's default."""
    shown = getattr(action, "shown_default", None)
    return shown if isinstance(shown, str) else _show(action.default)


def _add_field(
    group: argparse._ArgumentGroup, f: dataclasses.Field[Any], hint: Any, default: Any, note: str | None
) -> None:
    name = flag(f.name)
    help_text = f.metadata.get("help", "")
    kwargs: dict[str, Any] = {"dest": f.name, "help": help_text}
    if f.metadata.get("metavar"):
        kwargs["metavar"] = f.metadata["metavar"]
    origin, args = get_origin(hint), get_args(hint)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    shown: str | None = None
    if default is dataclasses.MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = default
        derived = f.metadata.get("shown_default")
        shown = derived if derived is not None and default == f.default else _show(default)
        if note:
            shown = f"{shown}; {note}"
        kwargs["help"] = f"{help_text} (default: {shown})"
    if base is bool:
        action = group.add_argument(name, action=argparse.BooleanOptionalAction, **kwargs)
    else:
        if (parse := f.metadata.get("parse")) is not None:
            kwargs["type"] = _converter(parse)
        elif get_origin(base) is Literal:
            kwargs["choices"] = list(get_args(base))
            kwargs["type"] = str
        elif get_origin(base) is tuple:
            kwargs["nargs"] = "*"
            kwargs["type"] = get_args(base)[0]
        elif base in (int, float) and optional:  # `--help` shows None as "off"; the flag takes it back
            kwargs["type"] = _converter(functools.partial(_optional_number, base))
        elif base in (int, float, str, Path):
            kwargs["type"] = base
        else:
            raise TypeError(f"no CLI mapping for field {f.name}: {hint!r}")
        action = group.add_argument(name, **kwargs)
    if shown is not None:
        action.shown_default = shown  # type: ignore[attr-defined]


def _optional_number(kind: type[int] | type[float], text: str) -> int | float | None:
    """An optional number flag's text: `off` (or `none`) for None, else the number."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"must be {what} or 'off', got {text!r}") from None


def _show(value: Any) -> str:
    if value is None:
        return "off"
    if isinstance(value, tuple | list):
        return " ".join(map(str, value)) or "none"
    return str(value)


def add_flags(
    group: argparse._ArgumentGroup,
    cls: type[Any],
    defaults: dict[str, Any] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """One flag per field of the dataclass `cls`; `defaults` entries for its fields are used (and
    removed) instead of the fields' own; `notes` adds to a flag's shown default."""
    hints = typing.get_type_hints(cls)
    defaults = {} if defaults is None else defaults
    for f in dataclasses.fields(cls):
        default = defaults.pop(f.name, f.default)
        _add_field(group, f, hints[f.name], default, (notes or {}).get(f.name))


def defaults_when_notes(defaults_when: Sequence[DefaultsWhen]) -> dict[str, str]:
    """What `--help` adds to each flag's default for the conditional defaults, by field name."""
    return {name: f"{_show(v)} {d.describe()}" for d in defaults_when for name, v in d.defaults.items()}


def build_parser(
    prog: str | None = None,
    *,
    description: str | None = None,
    defaults: Mapping[str, Any] | None = None,
    defaults_when: Sequence[DefaultsWhen] = (),
) -> FlagParser:
    """A parser for every RunConfig flag. `defaults` (by field name) override the dataclass defaults;
    `defaults_when` only show in `--help` here (`apply_defaults_when` applies them after parsing)."""
    defaults = dict(defaults or {})
    notes = defaults_when_notes(defaults_when)
    parser = FlagParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=defaults.pop("run_dir", None),
        help="Directory for everything the run writes (default: runs/<recipe>-<timestamp>).",
    )
    for _, cls, title in COMPONENTS:
        add_flags(parser.add_argument_group(title), cls, defaults, notes)
    if defaults:
        raise TypeError(f"unknown recipe defaults: {sorted(defaults)}")
    return parser


class _Unset:
    """Marks a dest the command line did not set (argparse leaves a preset attribute alone)."""


_UNSET = _Unset()


def parse_flags(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, *, known_only: bool = False
) -> ParsedFlags:
    """Parse `argv`: every dest's value, and which of them the command line set (argparse exits 2 on
    a bad one). `known_only`: leave unknown arguments in `unknown` instead of failing on them."""
    actions = [a for a in parser._actions if a.dest != argparse.SUPPRESS and a.default != argparse.SUPPRESS]
    preset = argparse.Namespace(**{a.dest: _UNSET for a in actions})
    unknown: list[str] = []
    if known_only:
        ns, unknown = parser.parse_known_args(argv, preset)
    else:
        ns = parser.parse_args(argv, preset)
    values: dict[str, Any] = {}
    given: set[str] = set()
    for a in actions:
        value = getattr(ns, a.dest)
        if value is _UNSET:
            value = a.default
            if isinstance(value, str) and callable(a.type):  # as argparse converts a string default
                value = a.type(value)
        else:
            given.add(a.dest)
        values[a.dest] = value
    return ParsedFlags(values=values, given=frozenset(given), unknown=tuple(unknown))


def apply_defaults_when(flags: ParsedFlags, defaults_when: Sequence[DefaultsWhen]) -> ParsedFlags:
    """`flags` with each `DefaultsWhen` whose condition holds applied to the flags the command line
    did not set (conditions are read from the values before any of them applies)."""
    values = dict(flags.values)
    for d in defaults_when:
        if d.holds(flags.values):
            values.update({k: v for k, v in d.defaults.items() if k not in flags.given})
    return dataclasses.replace(flags, values=values)


def component_from_values(cls: type[T], values: Mapping[str, Any]) -> T:
    """The dataclass `cls` from the values of its fields' flags (raises ConfigError)."""
    kwargs = {f.name: values[f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})


def config_from_values(values: Mapping[str, Any], *, run_dir: Path) -> RunConfig:
    """The validated (not yet resolved) RunConfig of parsed flag values (raises ConfigError)."""
    parts = {attr: component_from_values(cls, values) for attr, cls, _ in COMPONENTS}
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
    """Parse flags into a validated, resolved RunConfig, or exit 2 naming the offending flags."""
    parser = build_parser(prog, defaults=defaults)
    flags = parse_flags(parser, argv)
    run_dir = flags.values["run_dir"] or default_run_dir or Path("runs/run")
    try:
        return resolve(config_from_values(flags.values, run_dir=run_dir))
    except ConfigError as e:
        config_error_exit(parser, e)
