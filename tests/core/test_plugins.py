"""Plug-ins that cannot work are refused when the config is resolved (exit 2), not mid-run."""

from __future__ import annotations

from typing import Any

import pytest

from miles_aio.buffer import BufferItem, DataBuffer
from miles_aio.errors import ConfigError
from miles_aio.plugins import resolve_plugins
from miles_aio.types import Group
from tests.helpers import make_config

pytestmark = pytest.mark.pure


class IncompleteBuffer(DataBuffer):
    """A miles-style buffer: put/get only, no state for checkpoints, no close."""

    async def put(self, item: BufferItem) -> None: ...

    async def get(self, *, current_version: int | None = None, **context: Any) -> BufferItem:
        raise NotImplementedError


async def async_filter(ctx: Any, group: Group) -> bool:
    return False


def sync_filter(ctx: Any, group: Group) -> bool:
    return False


def test_a_buffer_missing_abstract_methods_is_a_config_error() -> None:
    cfg = make_config(custom_async_data_buffer_path="tests.core.test_plugins:IncompleteBuffer")
    with pytest.raises(ConfigError, match="does not implement") as info:
        resolve_plugins(cfg)
    message = str(info.value)
    assert "--custom-async-data-buffer-path" in message
    assert all(m in message for m in ("close", "get_metrics", "load_state_dict", "state_dict"))


def test_a_coroutine_dynamic_filter_is_a_config_error() -> None:
    cfg = make_config(dynamic_sampling_filter_path="tests.core.test_plugins:async_filter")
    with pytest.raises(ConfigError, match="coroutine function") as info:
        resolve_plugins(cfg)
    assert "--dynamic-sampling-filter-path" in str(info.value)
    ok = make_config(dynamic_sampling_filter_path="tests.core.test_plugins:sync_filter")
    assert resolve_plugins(ok).dynamic_filter_fn is sync_filter
