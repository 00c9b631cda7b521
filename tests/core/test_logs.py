"""Log lines: JSON with `--log-format json`, each carrying its component and the bound context."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog

from miles_aio.logs import configure_logging

pytestmark = pytest.mark.pure


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_json_lines_carry_component_and_bound_context(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("json")
    structlog.contextvars.bind_contextvars(step=3, version=4)
    structlog.get_logger("miles_aio.worker").info("admitted", group_id=7)
    structlog.get_logger("miles_aio.eval").debug("hidden below INFO")
    captured = capsys.readouterr()
    assert captured.out == ""  # stdout stays free for machine-readable output
    (line,) = captured.err.splitlines()
    record = json.loads(line)
    assert record["event"] == "admitted" and record["component"] == "worker"
    assert (record["step"], record["version"], record["group_id"]) == (3, 4, 7)
    assert record["level"] == "info" and record["timestamp"].endswith("Z")


def test_console_lines_name_the_component(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("console", level="DEBUG")
    structlog.get_logger("miles_aio.trainer").debug("rank ready", rank=1)
    err = capsys.readouterr().err
    assert "rank ready" in err and "component=trainer" in err and "rank=1" in err
