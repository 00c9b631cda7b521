"""Load user plug-ins given as import paths: `pkg.mod:attr` (or miles' dotted `pkg.mod.attr`)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_aio.errors import ConfigError, PluginError
from miles_aio.import_paths import IMPORTABLE, load_object, require_coroutine_function

if TYPE_CHECKING:
    from miles_aio.config import RunConfig

__all__ = ["IMPORTABLE", "Plugins", "load_object", "require_coroutine_function", "resolve_plugins"]

# -- the run's plug-ins, resolved once before anything starts ------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Plugins:
    generate_fn: Any
    reward_fn: Any | None
    dynamic_filter_fn: Any | None
    buffer_cls: type[Any]


def check_call_shape(fn: Any, path: str, flag: str, *, shape: str, nargs: int) -> None:
    """ConfigError naming `flag` unless `fn` accepts the `nargs` positional arguments it is called with
    (`shape` says which): a wrong signature is found before anything starts, not by every sample."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins and extension callables)
        return
    try:
        signature.bind(*range(nargs))
    except TypeError as e:
        raise ConfigError(
            f"{path!r} has the signature {signature}, but it is called as {shape} ({e})", flags=[flag]
        ) from None


def resolve_plugins(cfg: RunConfig) -> Plugins:
    """Import every plug-in path of the config; a bad path is a ConfigError naming its flag."""
    from miles_aio.buffer import DataBuffer, DefaultDataBuffer

    def load(path: str, flag: str, *, coroutine: bool) -> Any:
        try:
            return require_coroutine_function(path) if coroutine else load_object(path)
        except PluginError as e:
            raise ConfigError(str(e), flags=[flag]) from e

    r = cfg.rollout
    buffer_cls: type[Any] = DefaultDataBuffer
    if cfg.buffer.custom_async_data_buffer_path:
        buffer_cls = load(
            cfg.buffer.custom_async_data_buffer_path, "--custom-async-data-buffer-path", coroutine=False
        )
        if not (isinstance(buffer_cls, type) and issubclass(buffer_cls, DataBuffer)):
            raise ConfigError(
                f"{cfg.buffer.custom_async_data_buffer_path!r} is not a DataBuffer subclass",
                flags=["--custom-async-data-buffer-path"],
            )
        if inspect.isabstract(buffer_cls):  # found now, not when the controller builds it mid-start-up
            missing = ", ".join(sorted(buffer_cls.__abstractmethods__))
            raise ConfigError(
                f"{cfg.buffer.custom_async_data_buffer_path!r} does not implement {missing} "
                "(every abstract method of miles_aio.buffer.DataBuffer is needed)",
                flags=["--custom-async-data-buffer-path"],
            )
        from miles_aio.observability.buffer_staleness import with_staleness_metrics

        buffer_cls = with_staleness_metrics(buffer_cls)  # consume staleness even if the buffer reports none
    filter_fn = None
    if r.dynamic_sampling_filter_path:
        filter_fn = load(r.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path", coroutine=False)
        if not callable(filter_fn):
            raise ConfigError(
                f"{r.dynamic_sampling_filter_path!r} is not callable",
                flags=["--dynamic-sampling-filter-path"],
            )
        if inspect.iscoroutinefunction(filter_fn):  # its coroutine would be truthy: every group kept
            raise ConfigError(
                f"{r.dynamic_sampling_filter_path!r} is a coroutine function; a dynamic filter is a plain "
                "function fn(ctx, group) -> bool | (keep, reason) (await in the reward function instead)",
                flags=["--dynamic-sampling-filter-path"],
            )
        check_call_shape(
            filter_fn,
            r.dynamic_sampling_filter_path,
            "--dynamic-sampling-filter-path",
            shape="fn(ctx, group)",
            nargs=2,
        )
    post = cfg.train.custom_reward_post_process_path
    if post:  # the trainer loads it when it starts; a bad path exits 2 here, before anything starts
        fn = load(post, "--custom-reward-post-process-path", coroutine=False)
        if not callable(fn) or inspect.iscoroutinefunction(fn):
            raise ConfigError(
                f"{post!r} must be a plain function fn(args, samples) -> (raw_rewards, rewards)",
                flags=["--custom-reward-post-process-path"],
            )
        check_call_shape(fn, post, "--custom-reward-post-process-path", shape="fn(args, samples)", nargs=2)
    generate_path = r.custom_generate_function_path
    if r.custom_agent_function_path is not None:  # agent sessions: checked now, exit 2 before anything starts
        from miles_aio.rollout.agent import check_agent_config

        generate_path = check_agent_config(cfg)
    generate_fn = load(generate_path, "--custom-generate-function-path", coroutine=True)
    check_call_shape(
        generate_fn,
        generate_path,
        "--custom-generate-function-path",
        shape="await generate(ctx, sample, sampling_params)",
        nargs=3,
    )
    reward_fn = None
    if r.custom_rm_path:
        reward_fn = load(r.custom_rm_path, "--custom-rm-path", coroutine=True)
        shape = "await reward(ctx, samples) (--group-rm)" if r.group_rm else "await reward(ctx, sample)"
        check_call_shape(reward_fn, r.custom_rm_path, "--custom-rm-path", shape=shape, nargs=2)
    return Plugins(
        generate_fn=generate_fn,
        reward_fn=reward_fn,
        dynamic_filter_fn=filter_fn,
        buffer_cls=buffer_cls,
    )
