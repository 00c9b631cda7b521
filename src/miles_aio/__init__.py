"""miles_aio: an asyncio-native, single-controller runtime for fully asynchronous RL post-training."""

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
