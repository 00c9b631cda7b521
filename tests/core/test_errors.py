"""`errors.primary_error`: one error reported for a task group's failure, the others kept as notes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import structlog

from miles_aio.errors import primary_error

pytestmark = pytest.mark.vtime


class MyError(Exception):
    pass


def test_a_plain_exception_is_its_own_primary_and_gets_no_note() -> None:
    e = ValueError("x")
    assert primary_error(e) is e
    assert not hasattr(e, "__notes__")


def test_the_first_real_leaf_is_the_primary_and_every_other_one_a_note_and_a_log_line() -> None:
    first, second, third = MyError("group 3 failed"), KeyError("reward"), MyError("group 9 failed")
    group = ExceptionGroup(
        "outer", [ExceptionGroup("inner", [first, second]), third]
    )  # nested, as TaskGroups in TaskGroups raise
    with structlog.testing.capture_logs() as logs:
        primary = primary_error(group)
    assert primary is first
    assert primary.__notes__ == [
        "also raised: KeyError: 'reward'",
        "also raised: MyError: group 9 failed",
    ]
    logged = [e for e in logs if e["event"] == "an error raised alongside the reported one"]
    assert [e["error"] for e in logged] == [repr(second), repr(third)]
    assert all(e["exc_info"] is err for e, err in zip(logged, (second, third), strict=True))


def test_cancellations_are_no_errors_and_the_same_error_twice_is_one() -> None:
    err = MyError("boom")
    group = BaseExceptionGroup(
        "g",
        [asyncio.CancelledError(), BaseExceptionGroup("g2", [asyncio.CancelledError()]), err, err],
    )
    assert primary_error(group) is err
    assert not hasattr(err, "__notes__")  # a task that awaited the failed one re-raised the same object
    only_cancelled = BaseExceptionGroup("g", [asyncio.CancelledError("a"), asyncio.CancelledError("b")])
    assert isinstance(primary_error(only_cancelled), asyncio.CancelledError)


def test_prefer_picks_the_most_telling_error_and_a_second_call_adds_nothing(vrun: Any) -> None:
    async def main() -> None:
        async def fails(e: BaseException, delay: float) -> None:
            await asyncio.sleep(delay)
            raise e

        async with asyncio.TaskGroup() as tg:
            tg.create_task(fails(ValueError("a side effect"), 1.0), name="first")
            tg.create_task(fails(MyError("the reason"), 1.0), name="second")

    with pytest.raises(ExceptionGroup) as e:
        vrun(main())
    primary = primary_error(e.value, prefer=lambda x: isinstance(x, MyError))
    assert isinstance(primary, MyError)
    assert primary.__notes__ == ["also raised: ValueError: a side effect"]
    with structlog.testing.capture_logs() as logs:
        assert primary_error(e.value, prefer=lambda x: isinstance(x, MyError)) is primary
    assert primary.__notes__ == ["also raised: ValueError: a side effect"] and not logs


def test_the_primary_keeps_its_own_traceback_and_cause() -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as cause:
            raise MyError("outer") from cause
    except MyError as e:
        err = e
    tb = err.__traceback__
    primary = primary_error(ExceptionGroup("g", [err, ValueError("v")]))
    assert primary is err and primary.__traceback__ is tb and isinstance(primary.__cause__, KeyError)
