"""Child processes that cannot outlive their parent (simulators and policy servers in tests).

A test or benchmark that crashes (a segfault in a driver library, a CI timeout) must not leave
a 1 kHz simulator or a server running on a shared machine. On Linux the child asks the kernel
for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``); elsewhere this is a plain ``Popen``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def popen_tied(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` whose child is killed when this process dies."""
    if sys.platform.startswith("linux"):
        kwargs.setdefault("preexec_fn", _die_with_parent)
    return subprocess.Popen(args, **kwargs)
