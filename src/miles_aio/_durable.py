"""Crash-consistent file writes, and the fault hooks that the crash-consistency tests drive.

    write_all(fd, data, what)        every byte of `data` to `fd` (short writes continued)
    write_file_atomic(path, data)    `<path>.tmp`, fsync, rename over `path`, fsync the directory
    fsync_path(path) / fsync_dir(d)  make a file written by someone else (safetensors) / a rename durable

Fault hooks, inert unless their environment variable is set (read at each call, so rank processes
spawned with the variable obey it too). `what` is a file's base name, or `ledger.jsonl:checkpoint` for
the ledger's checkpoint marker; `#n` picks the n-th occurrence in this process (default: the first).

    MILES_AIO_FAULT_KILL_AT=<point>[#n]    SIGKILL this process when it reaches <point>: `save:<phase>`
                                           (a phase of `Controller.save`), `push:<phase>` (a phase of a weight
                                           push: `Controller._push_weights`, the router's transfer) or
                                           `write:<what>` (after about half of that write's bytes, cut inside
                                           a line, reached the file)
    MILES_AIO_FAULT_OSERROR_AT=<ERRNO>:<what>[#n]
                                           that write puts half its bytes in the file, then raises
                                           OSError(errno.<ERRNO>): ENOSPC as a full disk, EROFS as a file
                                           system remounted read-only, EIO, ...
    MILES_AIO_FAULT_ENOSPC_AT=<what>[#n]   the same as MILES_AIO_FAULT_OSERROR_AT=ENOSPC:<what>[#n]
"""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter
from pathlib import Path

__all__ = [
    "ENOSPC_ENV",
    "KILL_ENV",
    "OSERROR_ENV",
    "fault_point",
    "fsync_dir",
    "fsync_path",
    "write_all",
    "write_file_atomic",
]

KILL_ENV = "MILES_AIO_FAULT_KILL_AT"
ENOSPC_ENV = "MILES_AIO_FAULT_ENOSPC_AT"
OSERROR_ENV = "MILES_AIO_FAULT_OSERROR_AT"
_seen: Counter[tuple[str, str]] = Counter()


def _hit(env: str, point: str, spec: str | None = None) -> bool:
    """Whether the fault `env` names (`spec`: its value, or the part of it naming the point) fires at this
    occurrence of `point` (counts every occurrence)."""
    spec = os.environ.get(env) if spec is None else spec
    if not spec:
        return False
    target, _, nth = spec.partition("#")
    if target != point:
        return False
    _seen[env, point] += 1
    return _seen[env, point] == (int(nth) if nth else 1)


def _injected_errno(what: str) -> int | None:
    """The errno this write of `what` is to fail with (MILES_AIO_FAULT_OSERROR_AT / _ENOSPC_AT), or None."""
    if _hit(ENOSPC_ENV, what):
        return errno.ENOSPC
    name, sep, target = os.environ.get(OSERROR_ENV, "").partition(":")
    if not sep or not _hit(OSERROR_ENV, what, target):
        return None
    code = getattr(errno, name, None) if name.isupper() else None
    if not isinstance(code, int):
        raise ValueError(f"{OSERROR_ENV}: {name!r} is not an errno name (ENOSPC, EROFS, EIO, ...)")
    return code


def fault_point(point: str) -> None:
    """A place a test may kill this process at (MILES_AIO_FAULT_KILL_AT); nothing otherwise."""
    if _hit(KILL_ENV, point):
        os.kill(os.getpid(), signal.SIGKILL)


def write_all(fd: int, data: bytes, what: str) -> None:
    """Write all of `data` (the kernel may take less per call); the fault hooks apply to `what`."""
    view = memoryview(data)
    kill, code = _hit(KILL_ENV, f"write:{what}"), _injected_errno(what)
    if kill or code is not None:
        half = len(view) // 2
        if half and view[half - 1] == ord("\n"):
            half -= 1  # cut inside a line, never exactly after one
        while half:
            n = os.write(fd, view[:half])
            view, half = view[n:], half - n
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        assert code is not None
        raise OSError(code, os.strerror(code), what)
    while view:
        view = view[os.write(fd, view) :]


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make the entries of `directory` (a rename, a new or removed file) durable."""
    fsync_path(directory)


def write_file_atomic(path: Path, data: bytes) -> None:
    """`path` holds either its old content or all of `data`, also across a crash or a full disk."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data, path.name)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
