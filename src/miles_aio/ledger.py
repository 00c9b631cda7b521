"""The ledger: every admitted prompt group's fate, one JSON line per event, for exactly-once accounting.

Fates: `admitted`; then exactly one of `trained` (with step), `filtered` (dynamic filter, with reason),
`dropped` (unused handler `drop`, with reason), `recycled` (unused handler `retry`: the same group_id is
admitted again later), `failed` (user code raised under a drop policy); or `pending_at_exit` for
groups still in flight or buffered when the run stops. Steps are numbered as everywhere in a run: the
step that makes N steps done is step N (`trained` with step 1 is the first step's), and a checkpoint
marker's step is the N of its `step_N` (`pending_at_exit` carries the steps done at the exit).

Checkpoints and resume: a save writes a `{"event": "checkpoint", "step": s, "id": c}` line followed by
one `checkpointed_pending` line per open group (in flight, buffered, or drained but not yet trained),
and fsyncs them before it publishes `latest` (see `miles_aio.checkpoint` for the whole commit order).
A resumed run writes `{"event": "resume", "from_step": s, "checkpoint": c}`: everything after marker c
in the ledger is void (that progress was lost with the process, and the model was rolled back with
it), the open groups are those pending at the checkpoint, and those that were in flight are
`resubmitted`. Which marker a resume continues from is `committed_marker()`: a marker that was never
committed (a save killed before `latest` was renamed) is ignored.

Writes: events are buffered and written at each `flush()` (the controller's step loop flushes after
every step, a checkpoint marker is also fsynced), or once the buffer holds 4 MiB. The file is always a
prefix of the events recorded; a crash or a full disk can cut its last line only. After a failed
write the ledger writes nothing more (`error` holds it, `flush()`/`close()` raise it). Opening a
ledger for append repairs a torn last line (a complete event missing its newline gets one; a cut one
is truncated) and records the repair as a `{"event": "repaired_tail"}` line; `read_ledger()` skips
one torn last line, and rejects any other line that is not an event, naming file:line.

The file is append-only, so a resumed run continues the same ledger. `check_conservation()` is what
the tests use to prove that nothing is lost or duplicated, across kills and resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import structlog

from miles_aio._durable import fsync_dir, write_all
from miles_aio.errors import LedgerError

__all__ = [
    "Fate",
    "Ledger",
    "check_conservation",
    "committed_marker",
    "parse_ledger",
    "read_ledger",
]

log = structlog.get_logger("miles_aio.ledger")
AUTO_FLUSH_BYTES = 4 << 20

Fate = Literal[
    "admitted",
    "resubmitted",
    "trained",
    "filtered",
    "dropped",
    "recycled",
    "failed",
    "checkpointed_pending",
    "pending_at_exit",
]
TERMINAL: frozenset[str] = frozenset({"trained", "filtered", "dropped", "recycled", "failed"})


class Ledger:
    """Records fates; holds the set of groups admitted but not yet settled."""

    def __init__(self, path: Path | None, *, dataset_size: int) -> None:
        self._dataset_size = dataset_size
        self._open: set[int] = set()
        self.counts: Counter[str] = Counter()
        self.error: OSError | None = None  # the first failed write: nothing is written after it
        self.repaired: dict[str, Any] | None = None  # the `repaired_tail` event, when opening needed one
        self._path = path
        self._fd: int | None = None
        self._pending: list[str] = []
        self._pending_bytes = 0
        self._dir_synced = False
        self._error_raised = False  # whether `error` was raised to a caller already
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                self.repaired = _repair_tail(path, fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd

    def record(
        self, fate: Fate, group_id: int, *, step: int | None = None, reason: str | None = None
    ) -> None:
        if fate == "admitted":
            if group_id in self._open:
                raise RuntimeError(f"ledger: group {group_id} admitted while still open")
            self._open.add(group_id)
        elif fate in TERMINAL or fate == "pending_at_exit":
            if group_id not in self._open:
                raise RuntimeError(f"ledger: group {group_id} settled as {fate!r} but is not open")
            self._open.discard(group_id)
        elif group_id not in self._open:  # resubmitted, checkpointed_pending: informational, must be open
            raise RuntimeError(f"ledger: group {group_id} marked {fate!r} but is not open")
        self.counts[fate] += 1
        epoch, prompt_index = divmod(group_id, self._dataset_size)
        event: dict[str, Any] = {
            "group_id": group_id,
            "prompt_index": prompt_index,
            "epoch": epoch,
            "fate": fate,
        }
        if step is not None:
            event["step"] = step
        if reason is not None:
            event["reason"] = reason
        self._write(event)

    def open_groups(self) -> frozenset[int]:
        return frozenset(self._open)

    def mark_pending(
        self, fate: Literal["checkpointed_pending", "pending_at_exit"], *, step: int | None
    ) -> None:
        for gid in sorted(self._open):
            self.record(fate, gid, step=step)

    def checkpoint(self, step: int) -> str:
        """Mark a checkpoint (the open groups at this point are the ones a resume starts from), written
        and fsynced before this returns; returns the marker's id, which the checkpoint records."""
        self.flush()  # what came before: an ordinary write
        marker = uuid.uuid4().hex[:16]
        self._write({"event": "checkpoint", "step": step, "id": marker})
        self.mark_pending("checkpointed_pending", step=step)
        self._write_pending(f"{self._name}:checkpoint")
        self._fsync()
        return marker

    def resume(self, from_step: int, open_groups: set[int], *, checkpoint: str | None = None) -> None:
        """A resumed run starts here, with the groups pending at checkpoint `from_step` open."""
        event: dict[str, Any] = {"event": "resume", "from_step": from_step}
        if checkpoint is not None:
            event["checkpoint"] = checkpoint
        self._write(event)
        self._open = set(open_groups)

    @property
    def _name(self) -> str:
        return "ledger.jsonl" if self._path is None else self._path.name

    def _write(self, event: dict[str, Any]) -> None:
        if self._fd is None or self.error is not None:
            return
        line = json.dumps(event) + "\n"
        self._pending.append(line)
        self._pending_bytes += len(line)
        if self._pending_bytes >= AUTO_FLUSH_BYTES:
            with contextlib.suppress(OSError):  # kept in self.error; the next flush() (every step) raises it
                self._write_pending(self._name)
            self._error_raised = False

    def _write_pending(self, what: str) -> None:
        self._raise_if_failed()
        if self._fd is None or not self._pending:
            return
        data = "".join(self._pending).encode()
        self._pending, self._pending_bytes = [], 0
        try:
            write_all(self._fd, data, what)
        except OSError as e:
            self.error, self._error_raised = e, True  # the file stays a prefix: at most its last line is cut
            raise

    def _raise_if_failed(self) -> None:
        """After a failed write: its error, once; later calls fail without adding to its traceback."""
        if self.error is None:
            return
        if not self._error_raised:
            self._error_raised = True
            raise self.error
        raise LedgerError(f"{self._name}: not written since an earlier failure") from self.error

    def _fsync(self) -> None:
        if self._fd is None:
            return
        self._raise_if_failed()
        try:
            os.fsync(self._fd)
            if not self._dir_synced and self._path is not None:
                fsync_dir(self._path.parent)  # the file's own directory entry, once
                self._dir_synced = True
        except OSError as e:
            self.error, self._error_raised = e, True
            raise

    def flush(self) -> None:
        """Write every event recorded so far; raises the ledger's write error, now or from before."""
        self._write_pending(self._name)

    def close(self) -> None:
        """Write what is left, fsync and close. Raises a write error that nothing has raised yet; after
        one that was raised (the run is failing with it) it only closes the file."""
        if self._fd is None:
            return
        try:
            if not (self.error is not None and self._error_raised):
                self._write_pending(self._name)
                self._fsync()
        finally:
            os.close(self._fd)
            self._fd = None


def _as_event(line: str | bytes) -> dict[str, Any] | None:
    """The event a ledger line holds, or None when it is not a JSON object."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def _repair_tail(path: Path, fd: int) -> dict[str, Any] | None:
    """Before appending: a last line without its newline (a crash or a full disk cut the last write) is
    completed when it holds a whole event, else truncated; the repair is recorded (and fsynced) as a
    `repaired_tail` event with the fragment it dropped. A last complete line that is not an event is
    not a torn write: LedgerError, and the file is left as it is."""
    size = os.fstat(fd).st_size
    window = 1 << 16
    while True:  # enough of the tail to hold the unterminated piece and the last complete line
        start = max(0, size - window)
        data = os.pread(fd, size - start, start)
        cut = data.rfind(b"\n")
        if start == 0 or (cut >= 0 and data.rfind(b"\n", 0, cut) >= 0):
            break
        window *= 4
    if cut >= 0:
        complete = data[data.rfind(b"\n", 0, cut) + 1 : cut]
        if _as_event(complete) is None:
            with path.open("rb") as f:
                line_no = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
            raise LedgerError(f"{path}:{line_no}: not a ledger event: {complete[:120]!r}")
    tail = data[cut + 1 :]
    if not tail:
        return None
    if _as_event(tail) is not None:
        event: dict[str, Any] = {"event": "repaired_tail", "action": "added_newline"}
        repair = b"\n"
    else:
        os.ftruncate(fd, size - len(tail))
        fragment = tail.decode("utf-8", errors="replace")
        event = {"event": "repaired_tail", "action": "dropped_torn_line", "bytes": len(tail)}
        event["fragment"] = fragment
        repair = b""
    write_all(fd, repair + (json.dumps(event) + "\n").encode(), path.name)
    os.fsync(fd)
    log.warning(
        "ledger: repaired its last line", path=str(path), **{k: v for k, v in event.items() if k != "event"}
    )
    return event


def parse_ledger(text: str, *, name: str = "ledger") -> tuple[list[dict[str, Any]], str | None]:
    """The events of a ledger's text, and its torn last line (None when there is none).

    Exactly one torn line is tolerated: a last line without its newline that is not a JSON object (a
    write cut by a crash or a full disk). Any other line that is not an event, blank lines included, is
    a LedgerError naming `name:line`."""
    lines = text.split("\n")
    last = lines.pop()  # "" when the text ends with its newline
    events = []
    for number, line in enumerate(lines, 1):
        event = _as_event(line)
        if event is None:
            raise LedgerError(f"{name}:{number}: not a ledger event: {line[:120]!r}")
        events.append(event)
    if not last:
        return events, None
    event = _as_event(last)
    if event is None:
        return events, last
    events.append(event)
    return events, None


def committed_marker(events: Sequence[Mapping[str, Any]], step: int, checkpoint: str | None) -> int | None:
    """The index in `events` (the ledger before a resume) of the checkpoint marker that a resume from
    the checkpoint `latest` names (its step and the marker id its controller_state.json records)
    continues from; None when the ledger does not know that checkpoint.

    The rule: a save fsyncs its marker before it renames `latest` (the commit point), so a committed
    checkpoint's marker is always in the ledger, and a marker can be there without ever having been
    committed (the save was killed, or its disk filled, before the rename: in particular any marker
    for a step newer than `latest`). The committed one is the marker with the checkpoint's id (and
    step); without an id (a checkpoint from before marker ids) the last marker for that step. Every
    other marker is not committed for this resume; what follows the committed one is void."""
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        if e.get("event") != "checkpoint" or int(e["step"]) != step:
            continue
        if checkpoint is None or e.get("id") == checkpoint:
            return i
    return None


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """Every event of the ledger at `path` (one torn last line skipped, see `parse_ledger`)."""
    events, _ = parse_ledger(path.read_text(encoding="utf-8", errors="replace"), name=str(path))
    return events


def check_conservation(events: list[dict[str, Any]]) -> dict[str, int]:
    """Raise AssertionError unless every admission has exactly one terminal fate or is pending at exit.

    A `resume` event rolls the accounting back to its checkpoint (what happened after it was lost with
    the killed process), so a group may be trained again after a resume, but never twice in one history.
    Returns the per-fate counts.
    """
    open_: set[int] = set()
    trained: set[int] = set()
    snapshots: dict[int, tuple[set[int], set[int]]] = {}  # by the marker's index in `events`
    counts: Counter[str] = Counter()
    for i, e in enumerate(events):
        if "event" in e:
            if e["event"] == "checkpoint":
                snapshots[i] = (set(open_), set(trained))
            elif e["event"] == "resume":
                step, marker = int(e["from_step"]), e.get("checkpoint")
                at = committed_marker(events[:i], step, marker)
                assert at is not None, (
                    f"resume from step {step} (marker {marker}), which has no checkpoint in the ledger"
                )
                open_, trained = set(snapshots[at][0]), set(snapshots[at][1])
            continue
        gid, fate = int(e["group_id"]), e["fate"]
        counts[fate] += 1
        if fate == "admitted":
            assert gid not in open_, f"group {gid} admitted twice without a fate in between"
            open_.add(gid)
        elif fate in ("resubmitted", "checkpointed_pending"):
            assert gid in open_, f"group {gid} {fate} but not open"
        elif fate in TERMINAL or fate == "pending_at_exit":
            assert gid in open_, f"group {gid} got fate {fate!r} without being admitted"
            open_.discard(gid)
            if fate == "trained":
                assert gid not in trained, f"group {gid} (epoch {e['epoch']}) trained twice"
                trained.add(gid)
        else:
            raise AssertionError(f"unknown fate {fate!r}")
    assert not open_, f"groups admitted with no fate and not pending at exit: {sorted(open_)[:10]}"
    return dict(counts)
