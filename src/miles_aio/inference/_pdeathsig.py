"""Tie an engine process's life to the process that launched it, even if the launcher is SIGKILLed.

`die_with_parent(cmd)` wraps a command line so that, on Linux, the child first asks the kernel for
`PR_SET_PDEATHSIG` (a signal when its parent dies; the setting survives `execve`), then checks that its
parent is still the launcher (it may have died before the `prctl`: the classic race), then `exec`s the real
command, keeping its pid. A wrapper command rather than a `preexec_fn`: `preexec_fn` is unsafe in a
process with threads (torch's pools and asyncio's child watcher run some in the controller's process), and
the wrapper runs in a fresh interpreter.

Caveat (kernel semantics): the signal fires when the *thread* that forked the child exits. The launchers
fork from the event-loop thread, which lives as long as the controller does.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from typing import Final

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG: Final = 1
_ORPHANED_RC: Final = 3
"""The wrapper's exit code when the launcher was already gone before the real command started."""

# Run with `python -c`: a fresh interpreter that imports nothing of miles_aio (fast, and no package
# import side effects before the exec). argv: <parent pid> <signal number> <command...>
_WRAPPER: Final = f"""
import ctypes, os, sys
parent, sig, cmd = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
try:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl({_PR_SET_PDEATHSIG}, sig, 0, 0, 0) != 0:
        sys.stderr.write("die_with_parent: prctl failed: " + os.strerror(ctypes.get_errno()) + "\\n")
except (OSError, AttributeError) as exc:
    sys.stderr.write("die_with_parent: no prctl (" + str(exc) + "); not tied to the launcher\\n")
if os.getppid() != parent:
    sys.stderr.write("die_with_parent: the launcher exited before this process started\\n")
    sys.exit({_ORPHANED_RC})
os.execvp(cmd[0], cmd)
"""


def die_with_parent(cmd: Sequence[str], *, sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """`cmd`, wrapped so the process gets `sig` when this (the launching) process dies; `cmd` as is
    where the OS has no `PR_SET_PDEATHSIG` (not Linux)."""
    if not cmd:
        raise ValueError("empty command")
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-c", _WRAPPER, str(os.getpid()), str(int(sig)), *cmd]
