"""`finish_even_if_cancelled`: the work runs to its end whatever happens to the caller, in a TaskGroup."""

from __future__ import annotations

import asyncio

import pytest

from miles_aio._aio import finish_even_if_cancelled

pytestmark = pytest.mark.pure


def test_result_exception_and_cancellation() -> None:
    async def work(done: list[str], fail: bool = False) -> int:
        await asyncio.sleep(0.05)
        done.append("done")
        if fail:
            raise ValueError("boom")
        return 7

    async def main() -> None:
        done: list[str] = []
        assert await finish_even_if_cancelled(work(done)) == 7
        with pytest.raises(ValueError, match="boom"):  # the plain error, not an ExceptionGroup
            await finish_even_if_cancelled(work(done, fail=True))
        async with asyncio.TaskGroup() as tg:
            caller = tg.create_task(finish_even_if_cancelled(work(done)))
            await asyncio.sleep(0.01)
            caller.cancel()
            await asyncio.sleep(0)
            caller.cancel()  # twice: still waits
        assert caller.cancelled() and done == ["done"] * 3  # the cancelled caller's work still finished

    asyncio.run(main())
