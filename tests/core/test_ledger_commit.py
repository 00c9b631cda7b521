"""The ledger's half of crash consistency, as pure rules: which checkpoint marker a resume continues from
(`committed_marker`), the one torn line a reader tolerates (`parse_ledger`), the repair on open for
append, and a ledger that stops writing after a failed write (the file stays a prefix of the events)."""

from __future__ import annotations

import errno
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_aio import _durable, ledger
from miles_aio.errors import LedgerError
from miles_aio.ledger import Ledger, check_conservation, committed_marker, parse_ledger, read_ledger

pytestmark = pytest.mark.pure

NEW_ORDER = ("trainer", "marker", "state", "latest")  # Controller.save: `latest` is the commit point
OLD_ORDER = ("trainer", "state", "latest", "marker")  # what the operator found: `latest` before the marker


def fate(gid: int, name: str, step: int | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"group_id": gid, "prompt_index": gid, "epoch": 0, "fate": name}
    return event if step is None else event | {"step": step}


def simulate(
    plan: list[int | None], *, order: tuple[str, ...], ids: bool = True
) -> tuple[list[dict[str, Any]], list[str]]:
    """The ledger a run writes when save i is killed after `plan[i]` of its writes (None: it completes),
    each kill followed by a resume from what `latest` names. Each step admits 3 groups and trains the 2
    oldest open ones; a resume restores the open groups and the data position saved with `latest`, so
    the groups admitted after it are admitted again under the same ids. Returns the events and, per
    resume, the id of the marker of the save that published `latest`."""
    events: list[dict[str, Any]] = []
    expected: list[str] = []
    step, next_gid, open_ = 0, 0, []
    latest: tuple[int, str, tuple[int, list[int]]] | None = None
    for i, crash in enumerate(plan):
        for gid in range(next_gid, next_gid + 3):
            events.append(fate(gid, "admitted"))
            open_.append(gid)
        next_gid += 3
        for gid in open_[:2]:
            events.append(fate(gid, "trained", step))
        open_ = open_[2:]
        marker, saved = f"c{i}", (next_gid, list(open_))
        for action in order if crash is None else order[:crash]:
            if action == "marker":
                events.append({"event": "checkpoint", "step": step, "id": marker})
                events.extend(fate(g, "checkpointed_pending", step) for g in open_)
            elif action == "latest":
                latest = (step, marker, saved)
        if crash is None:
            step += 1
            continue
        assert latest is not None  # the first save always completes
        from_step, committed, (next_gid, restored) = latest
        events.append(
            {"event": "resume", "from_step": from_step} | ({"checkpoint": committed} if ids else {})
        )
        expected.append(committed)
        step, open_ = from_step + 1, list(restored)
    events.extend(fate(g, "pending_at_exit") for g in open_)
    return events, expected


crash_plans = st.lists(st.none() | st.integers(0, 4), min_size=0, max_size=12).map(lambda p: [None, *p])


@settings(max_examples=300, deadline=None)
@given(plan=crash_plans, ids=st.booleans())
def test_with_latest_last_every_crash_leaves_a_checkpoint_the_ledger_knows(
    plan: list[int | None], ids: bool
) -> None:
    events, expected = simulate(plan, order=NEW_ORDER, ids=ids)
    check_conservation(events)  # nothing lost, nothing trained twice in the history that survives
    resumes = [i for i, e in enumerate(events) if e.get("event") == "resume"]
    assert len(resumes) == len(expected)
    for at, committed in zip(resumes, expected, strict=True):
        e = events[at]
        marker = committed_marker(events[:at], e["from_step"], e.get("checkpoint"))
        assert marker is not None and events[marker]["id"] == committed
        # markers written after the committed one (killed before `latest`) were not taken
        later = [m for m in events[marker + 1 : at] if m.get("event") == "checkpoint"]
        assert all(m["id"] != committed for m in later)


def test_latest_before_the_marker_is_what_broke() -> None:
    """The model can fail: with the old order a kill between `latest` and the marker (3 writes done) leaves
    a resumable checkpoint the ledger does not know, as the operator found."""
    events, _ = simulate([None, 3, None], order=OLD_ORDER)
    with pytest.raises(AssertionError, match=r"resume from step 1 .*no checkpoint in the ledger"):
        check_conservation(events)


def test_the_committed_marker_is_the_one_with_the_checkpoints_id() -> None:
    events = [
        {"event": "checkpoint", "step": 1, "id": "a"},
        {"event": "checkpoint", "step": 3, "id": "b"},  # killed before `latest` named it
        {"event": "resume", "from_step": 1, "checkpoint": "a"},
        {"event": "checkpoint", "step": 3, "id": "c"},
    ]
    assert committed_marker(events, 3, "c") == 3
    assert committed_marker(events, 3, "b") == 1  # an explicit load of that step directory: a fork
    assert committed_marker(events, 3, None) == 3  # a checkpoint without an id: the last marker
    assert committed_marker(events, 1, "c") is None  # an id is only that step's
    assert committed_marker(events, 5, None) is None


# -- the reader: exactly one torn last line ------------------------------------------------------------
events_st = st.lists(
    st.builds(fate, st.integers(0, 10**6), st.sampled_from(["admitted", "trained", "pending_at_exit"]))
    | st.builds(lambda s, i: {"event": "checkpoint", "step": s, "id": i}, st.integers(0, 99), st.text("ab0")),
    min_size=1,
    max_size=6,
)


def serialize(events: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


@settings(max_examples=200, deadline=None)
@given(events=events_st, data=st.data())
def test_a_cut_anywhere_leaves_a_prefix_and_at_most_the_last_line_torn(
    events: list[dict[str, Any]], data: st.DataObject
) -> None:
    text = serialize(events)
    cut = data.draw(st.integers(0, len(text)))
    got, torn = parse_ledger(text[:cut])
    complete = text[:cut].count("\n")
    assert got == events[: len(got)]
    whole_but_newline = cut < len(text) and text[cut] == "\n"  # the cut took only the newline
    assert len(got) == complete + int(whole_but_newline)
    assert torn == (None if whole_but_newline else text[:cut].rpartition("\n")[2] or None)


@given(events=events_st, data=st.data())
def test_any_other_bad_line_is_an_error_naming_it(events: list[dict[str, Any]], data: st.DataObject) -> None:
    lines = serialize(events).splitlines(keepends=True)
    at = data.draw(st.integers(0, len(lines)))
    bad = data.draw(st.sampled_from(["\n", "not json\n", "[1, 2]\n", '{"torn": \n']))
    lines.insert(at, bad)  # inside the file, or a last line that has its newline: not a torn write
    with pytest.raises(LedgerError, match=f"ledger:{at + 1}: not a ledger event"):
        parse_ledger("".join(lines))


# -- the writer: the repair on open, and no write after a failed one ------------------------------------
@settings(max_examples=100, deadline=None)
@given(events=events_st, data=st.data())
def test_opening_for_append_repairs_a_torn_tail_and_records_it(
    events: list[dict[str, Any]], data: st.DataObject
) -> None:
    text = serialize(events)
    cut = data.draw(st.integers(0, len(text)))
    before, torn = parse_ledger(text[:cut])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.jsonl"
        path.write_text(text[:cut])
        led = Ledger(path, dataset_size=10**7)
        led.resume(0, set())
        led.close()
        after = read_ledger(path)
        assert path.read_text().endswith("\n")
    repaired = [] if led.repaired is None else [led.repaired]
    assert after == [*before, *repaired, {"event": "resume", "from_step": 0}]
    if torn is not None:
        assert repaired == [
            {"event": "repaired_tail", "action": "dropped_torn_line", "bytes": len(torn), "fragment": torn}
        ]
    elif cut and text[cut - 1] != "\n":
        assert repaired == [{"event": "repaired_tail", "action": "added_newline"}]
    else:
        assert repaired == []


def test_a_bad_complete_last_line_is_refused_on_open_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    content = serialize([fate(1, "admitted")]) + "garbage\n"
    path.write_text(content)
    with pytest.raises(LedgerError, match=r"ledger.jsonl:2: not a ledger event"):
        Ledger(path, dataset_size=10)
    assert path.read_text() == content


@pytest.fixture
def fresh_faults(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(_durable, "_seen", Counter())
    return monkeypatch


def test_a_failed_marker_write_is_raised_and_nothing_is_written_after_it(
    tmp_path: Path, fresh_faults: pytest.MonkeyPatch
) -> None:
    fresh_faults.setenv(_durable.ENOSPC_ENV, "ledger.jsonl:checkpoint")
    path = tmp_path / "ledger.jsonl"
    led = Ledger(path, dataset_size=10)
    for gid in range(3):
        led.record("admitted", gid)
    with pytest.raises(OSError, match="No space left") as info:
        led.checkpoint(0)
    assert info.value.errno == errno.ENOSPC and led.error is info.value
    size = path.stat().st_size
    led.record("trained", 0, step=0)  # in memory still; not written
    with pytest.raises(LedgerError, match="since an earlier failure"):
        led.flush()
    led.close()  # the run already fails with the error: closing raises nothing more
    assert path.stat().st_size == size
    events, torn = parse_ledger(path.read_text())
    assert events[:3] == [fate(g, "admitted") for g in range(3)] and events[3]["event"] == "checkpoint"
    assert torn is not None  # half of the marker's write reached the file


def test_a_failed_background_write_is_raised_by_the_next_flush_once(
    tmp_path: Path, fresh_faults: pytest.MonkeyPatch
) -> None:
    fresh_faults.setenv(_durable.ENOSPC_ENV, "ledger.jsonl")
    fresh_faults.setattr(ledger, "AUTO_FLUSH_BYTES", 1)  # every record writes
    led = Ledger(tmp_path / "ledger.jsonl", dataset_size=10)
    led.record("admitted", 0)  # its write fails: kept, not raised inside the caller's callback
    assert led.error is not None and led.error.errno == errno.ENOSPC
    with pytest.raises(OSError, match="No space left") as info:
        led.flush()
    assert info.value is led.error
    led.close()


@pytest.mark.parametrize("spec", ["EROFS:x.json#2", "EIO:x.json#2"])
def test_the_oserror_hook_fails_the_nth_write_with_its_errno_after_half_of_it(
    tmp_path: Path, fresh_faults: pytest.MonkeyPatch, spec: str
) -> None:
    fresh_faults.setenv(_durable.OSERROR_ENV, spec)
    path = tmp_path / "x.json"
    _durable.write_file_atomic(path, b"first")  # the 1st write of x.json: untouched
    with pytest.raises(OSError, match=r"\[Errno \d+\]") as info:
        _durable.write_file_atomic(path, b"0123456789")
    assert info.value.errno == getattr(errno, spec.partition(":")[0])
    assert path.read_bytes() == b"first" and (tmp_path / "x.json.tmp").read_bytes() == b"01234"


def test_the_oserror_hook_rejects_a_name_that_is_no_errno(
    tmp_path: Path, fresh_faults: pytest.MonkeyPatch
) -> None:
    fresh_faults.setenv(_durable.OSERROR_ENV, "errorcode:x.json")
    with pytest.raises(ValueError, match="not an errno name"):
        _durable.write_file_atomic(tmp_path / "x.json", b"data")


def test_close_raises_a_write_error_nothing_raised_yet(
    tmp_path: Path, fresh_faults: pytest.MonkeyPatch
) -> None:
    fresh_faults.setenv(_durable.ENOSPC_ENV, "ledger.jsonl")
    led = Ledger(tmp_path / "ledger.jsonl", dataset_size=10)
    led.record("admitted", 0)
    with pytest.raises(OSError, match="No space left"):
        led.close()
