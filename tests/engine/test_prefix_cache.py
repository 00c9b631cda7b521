"""The embedded engine's prefix cache lookup against a brute-force reference (pure, no engine)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_aio.engine.runner import PrefixCache

pytestmark = pytest.mark.pure

tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)


def reference(entries: list[tuple[list[int], int]], query: list[int], epoch: int) -> int:
    best = 0
    for toks, e in entries:
        if e != epoch:
            continue
        n, i = min(len(toks), len(query) - 1), 0
        while i < n and toks[i] == query[i]:
            i += 1
        best = max(best, i)
    return best


@given(st.lists(st.tuples(tokens, st.integers(0, 1)), max_size=8), tokens, st.integers(0, 1))
def test_lookup_finds_the_longest_reusable_prefix_of_the_current_epoch(
    entries: list[tuple[list[int], int]], query: list[int], epoch: int
) -> None:
    cache = PrefixCache(max_entries=100)
    for toks, e in entries:
        cache.insert(toks, [], [], epoch=e)
    kept = {tuple(t): e for t, e in entries}  # a re-inserted prompt replaces the older entry
    n, entry = cache.lookup(query, epoch=epoch)
    assert n == reference([(list(t), e) for t, e in kept.items()], query, epoch)
    assert n < len(query) or n == 0  # the last token is always fed
    if n:
        assert entry is not None and entry.epoch == epoch
        assert entry.tokens[:n].tolist() == query[:n]
