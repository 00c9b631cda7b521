"""`python -m miles_aio.engine`: start one embedded CPU engine (`--rollout-backend local`).

    python -m miles_aio.engine --model-path DIR [--port 0] [--host 127.0.0.1] [--api-key KEY] ...

Flags are checked before torch is imported, so a bad invocation fails in milliseconds with exit code 2.
Serving on a non-loopback address requires `--api-key`: the server accepts weight paths and
torch.distributed rendezvous addresses from its clients.
Request timeouts use SGLang's environment variables, read once at start: `SGLANG_REQ_WAITING_TIMEOUT`,
`SGLANG_REQ_RUNNING_TIMEOUT` (seconds; unset or <= 0: off; see `timeouts.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import ipaddress
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

__all__ = ["API_KEY_ENV", "build_parser", "is_loopback", "main"]

API_KEY_ENV: Final = "MILES_AIO_ENGINE_API_KEY"
"""The API key, when not given as `--api-key` (launchers pass it this way: argv is world-readable)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m miles_aio.engine",
        description="Embedded CPU inference engine serving SGLang's native HTTP API (a subset) with a torch "
        "Llama forward and continuous batching. Prints one JSON line {event: ready, host, port, pid} to "
        "stdout once it listens. Logs go to stderr. `kill -USR1 <pid>` dumps every thread's stack.",
    )
    add = p.add_argument
    add(
        "--model-path",
        type=Path,
        required=True,
        help="HF Llama dir: config.json, *.safetensors, tokenizer.json",
    )
    add(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: %(default)s); not loopback: needs --api-key",
    )
    add(
        "--port",
        type=int,
        default=0,
        help="TCP port; 0 (default) picks a free one, reported in the ready line",
    )
    add(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health*, /ready (default: "
        f"${API_KEY_ENV} if set, which keeps the key out of the process list; else none)",
    )
    add(
        "--weights-root",
        type=Path,
        default=None,
        help="update_weights_from_disk reads only under this dir (default: the parent of --model-path)",
    )
    add(
        "--max-running-requests",
        type=int,
        default=64,
        help="requests decoded together, one KV slot each (default: %(default)s)",
    )
    add(
        "--context-length",
        type=int,
        default=None,
        help="max prompt + output tokens per request (default: the model's max_position_embeddings)",
    )
    add("--num-threads", type=int, default=1, help="torch intra-op threads for model compute (default: 1)")
    add("--seed", type=int, default=0, help="seeds requests that carry no sampling_seed (default: 0)")
    add("--weight-version", default="default", help="initial weight version label (default: %(default)s)")
    add(
        "--prefix-cache-entries",
        type=int,
        default=64,
        help="prompts whose KV is kept for reuse, 0 disables (default: %(default)s)",
    )
    add("--served-model-name", default=None, help="name in /model_info (default: the --model-path)")
    add(
        "--watchdog-timeout",
        type=float,
        default=300.0,
        help="SGLang's: no forward step for this many seconds while requests are in the running batch "
        "(a hung step, or an in_place pause that froze them) logs, dumps stacks and kills the server "
        "(default: %(default)s)",
    )
    add(
        "--soft-watchdog-timeout",
        type=float,
        default=None,
        help="SGLang's: the same condition only logs and dumps stacks, again every timeout (default: off)",
    )
    add(
        "--exit-on-stdin-eof",
        action="store_true",
        help="shut down when stdin closes: the launcher's pipe, so no engine outlives its launcher",
    )
    add(
        "--log-format",
        choices=("console", "json"),
        default="console",
        help="stderr log format (default: console)",
    )
    add("--log-level", default="INFO", help="stderr log level (default: %(default)s)")
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(args.host) and not args.api_key:
        # parser.error exits 2. The server takes weight paths and rendezvous addresses from its clients.
        parser.error(f"--host {args.host} is not a loopback address: refusing to serve without --api-key")
    if not (args.model_path / "config.json").is_file():
        parser.error(f"--model-path {args.model_path}: no config.json there")
    for flag, value, lo in (
        ("--max-running-requests", args.max_running_requests, 1),
        ("--num-threads", args.num_threads, 1),
        ("--port", args.port, 0),
        ("--prefix-cache-entries", args.prefix_cache_entries, 0),
    ):
        if value < lo:
            parser.error(f"{flag} must be >= {lo}, got {value}")
    for flag, seconds in (
        ("--watchdog-timeout", args.watchdog_timeout),
        ("--soft-watchdog-timeout", args.soft_watchdog_timeout),
    ):
        if seconds is not None and not seconds > 0:
            parser.error(f"{flag} must be > 0, got {seconds}")
    if args.context_length is not None and args.context_length < 2:
        parser.error(f"--context-length must be >= 2, got {args.context_length}")
    if args.weights_root is not None and not args.weights_root.is_dir():
        parser.error(f"--weights-root {args.weights_root} is not a directory")

    # Imported only once the flags are valid: this pulls in torch (seconds).
    from miles_aio.engine.server import ServerConfig, serve
    from miles_aio.engine.timeouts import Limits
    from miles_aio.logs import configure_logging

    configure_logging(args.log_format, args.log_level)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack to stderr
    cfg = ServerConfig(
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        weights_root=args.weights_root,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        num_threads=args.num_threads,
        seed=args.seed,
        weight_version=args.weight_version,
        prefix_cache_entries=args.prefix_cache_entries,
        served_model_name=args.served_model_name,
        watchdog_timeout=args.watchdog_timeout,
        soft_watchdog_timeout=args.soft_watchdog_timeout,
        request_timeouts=Limits.from_env(),  # SGLANG_REQ_WAITING_TIMEOUT, SGLANG_REQ_RUNNING_TIMEOUT
        exit_on_stdin_eof=args.exit_on_stdin_eof,
    )
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:  # e.g. the port is taken
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0
