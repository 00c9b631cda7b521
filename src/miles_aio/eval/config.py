"""Eval flags live in `miles_aio.config.EvalConfig` (re-exported here)."""

from miles_aio.config import EvalConfig

__all__ = ["EvalConfig"]
