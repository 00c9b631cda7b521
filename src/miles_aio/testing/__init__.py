"""Fakes for the seams, shipped so users' own scheduler tests can use them too.

They are fakes, named as such: `FakeLatencyEngine` models an engine by per-request latency (no
model, no HTTP), `FakeTrainer` by step time. Engine behaviour is tested against real HTTP servers.
"""

from miles_aio.testing.fakes import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency

__all__ = ["FakeLatencyEngine", "FakeTokenizer", "FakeTrainer", "LogNormalLatency"]
