"""Fakes for the seams, shipped so users' own scheduler tests can use them too.

They are fakes, named as such: `FakeLatencyEngine` models engines by request latency or by
continuous batching of response lengths (no model, no HTTP), `FakeTrainer` by step time, and
`sglang_stub_server.SGLangStubServer` is SGLang's HTTP API with zero model work, for the client,
contract and fault tests that need real HTTP.
"""

from miles_aio.testing.fakes import (
    EmpiricalLengths,
    FakeLatencyEngine,
    FakeTokenizer,
    FakeTrainer,
    LogNormal,
    LogNormalLatency,
)

__all__ = [
    "EmpiricalLengths",
    "FakeLatencyEngine",
    "FakeTokenizer",
    "FakeTrainer",
    "LogNormal",
    "LogNormalLatency",
]
