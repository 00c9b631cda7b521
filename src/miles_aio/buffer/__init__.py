"""The awaitable DataBuffer between the rollout worker (put) and the driver (get)."""

from miles_aio.buffer.base import DataBuffer, DataBufferContext, FilterDecision
from miles_aio.buffer.default import DefaultDataBuffer
from miles_aio.types import BufferItem

__all__ = ["BufferItem", "DataBuffer", "DataBufferContext", "DefaultDataBuffer", "FilterDecision"]
