"""miles_aio: an asyncio-native, single-controller runtime for fully asynchronous RL post-training."""

import os

# A run's processes share the CPU cores: on a CPU box the engines, the trainer ranks and the controller
# all run torch at once. OpenMP's default is to keep idle worker threads spinning, so one process's idle
# threads take the cores another process is computing on: on 2 cores under load a 2-thread forward +
# backward took 6.6 s spinning and 0.19 s with PASSIVE. OpenMP reads this when torch loads it, and every
# process of a run imports this package before torch (the engine and rank entry points are modules of
# it; children inherit the environment). A value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from miles_aio.buffer import BufferItem, DataBuffer, DataBufferContext, DefaultDataBuffer, FilterDecision
from miles_aio.config import RunConfig
from miles_aio.controller import Controller, RunSummary
from miles_aio.rollout.context import RolloutContext
from miles_aio.types import GenerateOutput, Group, Sample, Status

__all__ = [
    "BufferItem",
    "Controller",
    "DataBuffer",
    "DataBufferContext",
    "DefaultDataBuffer",
    "FilterDecision",
    "GenerateOutput",
    "Group",
    "RolloutContext",
    "RunConfig",
    "RunSummary",
    "Sample",
    "Status",
]

__version__ = "0.1.0"
