"""Evaluation on the controller's loop. Mode 1 (shared engines) is `SharedEngineEval`."""

from miles_aio.eval.config import EvalConfig
from miles_aio.eval.dispatcher import EvalDispatcher
from miles_aio.eval.shared import SharedEngineEval

__all__ = ["EvalConfig", "EvalDispatcher", "SharedEngineEval"]
