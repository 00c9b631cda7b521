"""The `--sglang-<flag>` passthrough checked before anything starts: against SGLang's own server
arguments (`sglang.srt.server_args.ServerArgs.add_cli_args`) when sglang is importable here, so a typo
is an exit 2 naming the flag instead of every SGLang server failing to start minutes later. Where it
is not importable (not installed, or installed with `pip install --no-deps`: its dependencies
missing), or where no SGLang server of this run would get them, the recipe logs one warning instead.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence

from miles_aio.config import RunConfig
from miles_aio.errors import ConfigError

__all__ = ["check_sglang_args", "sglang_server_flags", "unknown_sglang_flags"]


def sglang_server_flags() -> frozenset[str] | str:
    """Every option string of SGLang's `launch_server`; or, when they cannot be read here, why not."""
    try:
        from sglang.srt.server_args import ServerArgs  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except Exception as e:  # not installed, or without its dependencies (`pip install --no-deps sglang`)
        return f"sglang is not importable here ({type(e).__name__}: {e})"
    parser = argparse.ArgumentParser(add_help=False)
    try:
        ServerArgs.add_cli_args(parser)
    except Exception as e:  # a version whose parser needs more than this process has (e.g. a GPU)
        return f"sglang's server arguments could not be listed here ({type(e).__name__}: {e})"
    return frozenset(s for action in parser._actions for s in action.option_strings)


def unknown_sglang_flags(args: Sequence[str], known: frozenset[str]) -> list[str]:
    """The flags of `args` (`--flag [value]` / `--flag=value`) SGLang's parser would refuse: neither one
    of `known` nor an unambiguous prefix of one (argparse's abbreviations, which SGLang allows)."""
    unknown = []
    for arg in args:
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        if name in known or len([k for k in known if k.startswith(name)]) == 1:
            continue
        unknown.append(name)
    return unknown


def _launches(cfg: RunConfig) -> tuple[bool, bool]:
    """Whether this run launches SGLang servers for rollout, and for the dedicated eval engines."""
    e, ev = cfg.engine, cfg.eval
    sglang = e.rollout_backend == "sglang"
    return sglang and not e.sglang_urls, sglang and ev.eval_num_gpus > 0 and not ev.eval_sglang_urls


def check_sglang_args(
    cfg: RunConfig,
    sglang_args: Sequence[str],
    eval_sglang_args: Sequence[str],
    *,
    server_flags: frozenset[str] | str | None = None,
) -> list[str]:
    """ConfigError naming the `--sglang-<flag>` (or `--eval-sglang-<flag>`) that SGLang's server does
    not have; else the warnings to log: passthrough flags no launched server would get, or flags that
    cannot be checked here. `server_flags` (tests): what `sglang_server_flags()` would return."""
    if not sglang_args and not eval_sglang_args:
        return []
    rollout, evals = _launches(cfg)
    if not rollout and not evals:
        why = (
            "the servers given by --sglang-urls run with their own flags"
            if cfg.engine.sglang_urls
            else f"no SGLang server is launched (--rollout-backend {cfg.engine.rollout_backend})"
        )
        return [f"--sglang-* flags not used: {why}"]
    known = sglang_server_flags() if server_flags is None else server_flags
    if isinstance(known, str):
        return [f"--sglang-* flags not checked: {known}; a wrong one fails when the SGLang servers start"]
    for prefix, args in (("--sglang-", sglang_args), ("--eval-sglang-", eval_sglang_args)):
        for name in unknown_sglang_flags(args, known):
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {prefix}{close[0][2:]}?)" if close else ""
            raise ConfigError(
                f"SGLang's server has no {name}{hint}", flags=[prefix + name.removeprefix("--")]
            )
    return []
