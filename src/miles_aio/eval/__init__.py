"""Evaluation on the controller's loop, three backends (`build_eval_dispatcher` picks one):

  mode 1  `SharedEngineEval`: the rollout engines, between weight pushes (`EvalDispatcher`)
  mode 2  `DedicatedEngineEval`: a dedicated fleet (`open_eval_engines`) loading HF snapshots
  mode 3  a user's `CheckpointEvalFn` (--eval-function-path) on HF snapshots
Modes 2 and 3 run fire-and-forget under `SnapshotEvalDispatcher`.
"""

from miles_aio.eval.build import build_eval_dispatcher
from miles_aio.eval.config import EvalConfig
from miles_aio.eval.dispatcher import EvalDispatcher, EvalPoints
from miles_aio.eval.external import CheckpointEvalFn, CheckpointEvalInput
from miles_aio.eval.fleet import DedicatedEngineEval, open_eval_engines
from miles_aio.eval.shared import SharedEngineEval
from miles_aio.eval.snapshot_dispatcher import SnapshotEvalDispatcher
from miles_aio.eval.snapshots import EvalSkip

__all__ = [
    "CheckpointEvalFn",
    "CheckpointEvalInput",
    "DedicatedEngineEval",
    "EvalConfig",
    "EvalDispatcher",
    "EvalPoints",
    "EvalSkip",
    "SharedEngineEval",
    "SnapshotEvalDispatcher",
    "build_eval_dispatcher",
    "open_eval_engines",
]
