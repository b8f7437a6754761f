"""What every writer of a dataset, checkpoint or run folder shares: exclusive locks another writer
cannot take away from it, and disk-full errors that say which file and how much space is left.

Locks are OS-level and die with their process, so a SIGKILLed writer never leaves a stale lock. A
lock *file* can be deleted while its holder runs (and a second writer would then lock a new file of
the same name), so each writer also locks what it writes itself: the dataset's ``.partial`` (an
open-file-description lock, which HDF5's own ``flock`` and ``HDF5_USE_FILE_LOCKING`` do not touch)
or the run folder (``flock`` on the directory, which cannot be deleted while it holds files).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import struct
from pathlib import Path
from typing import Iterator

from envs.errors import GroundflowError


class DiskFullError(GroundflowError, OSError):
    """A write failed (or would fail) for lack of space, a quota or the file size limit; ``errno`` says
    which (ENOSPC, EDQUOT, EFBIG), the message is one line naming the file and the space left."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code


class InUseError(GroundflowError, RuntimeError):
    """An output another live process is writing."""


# ----- locks ------------------------------------------------------------------------------------

def lock_exclusive(fd: int) -> None:
    """An exclusive lock on the open file ``fd``, tied to this open file description (so neither
    another open() of the file in this process nor HDF5's flock on its own descriptor touches it);
    BlockingIOError when another description holds it."""
    if hasattr(fcntl, "F_OFD_SETLK"):
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        except PermissionError as e:  # some systems say EACCES for a held lock
            raise BlockingIOError(errno.EAGAIN, str(e)) from e
    else:  # (no OFD locks: not Linux) flock, which HDF5 also takes: h5py must then open with locking=False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, not replaced)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def holders(fd: int) -> str:
    """Who else has the file open as ``fd`` open: 'pid 123: groundflow collect --env ...', from /proc
    (empty where /proc does not say, e.g. another user's processes or another machine)."""
    own = os.fstat(fd)
    found = []
    with contextlib.suppress(OSError):
        for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
            if int(pid) == os.getpid():
                continue
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for name in fds:
                try:
                    st = os.stat(f"/proc/{pid}/fd/{name}")
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
                    found.append(f"pid {pid}: {_command(int(pid))}")
                    break
    return "; ".join(found[:3])


def _command(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    argv = [a for a in argv if a]
    if len(argv) > 2 and argv[1] == "-m" and argv[2] in ("groundflow", "groundflow.cli"):
        argv = ["groundflow", *argv[3:]]  # what the user typed
    elif argv:
        argv[0] = Path(argv[0]).name
    text = " ".join(argv)
    return text if len(text) <= 100 else text[:97] + "..."


def other_process(fd: int) -> str:
    """'another process (pid 123: groundflow collect ...)' for messages."""
    who = holders(fd)
    return f"another process ({who})" if who else "another process"


@contextlib.contextmanager
def hold_directory(path: Path, flag: str = "--out") -> Iterator[Path]:
    """Create ``path`` if needed and hold an exclusive lock on it while the block runs: a second
    holder gets one InUseError naming the folder and the process that holds it. A folder this call
    created and the block left empty (it failed before writing) is removed again."""
    path = Path(path)
    created = not path.exists()
    while True:
        path.mkdir(parents=True, exist_ok=True)
        fd, locked = os.open(path, os.O_RDONLY | os.O_DIRECTORY), path
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise
            except OSError:  # NFS emulates flock with byte-range locks, which a directory cannot take
                os.close(fd)
                fd, locked = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644), path / ".lock"
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = other_process(fd)
            os.close(fd)
            raise InUseError(f"{flag} {path} is in use by {who}; wait for it to finish or give another {flag}") \
                from None
        if same_file(fd, locked):  # not removed or renamed between the open and the lock
            break
        os.close(fd)
    try:
        yield path
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                if locked != path:
                    locked.unlink()
                path.rmdir()  # only if empty
        raise
    finally:
        os.close(fd)


# ----- disk space -------------------------------------------------------------------------------

_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
         errno.EFBIG: "file too large"}
_FULL_TEXT = {errno.ENOSPC: ("no space left on device", "os error 28", "errno = 28"),
              errno.EDQUOT: ("disk quota exceeded", "os error 122", "errno = 122"),
              errno.EFBIG: ("file too large", "os error 27", "errno = 27")}


def disk_full_errno(e: BaseException | None) -> int | None:
    """ENOSPC, EDQUOT or EFBIG when ``e`` (or an error it was raised from: torch and safetensors wrap
    the OSError in their own) is a write that found no room; None otherwise."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return e.errno
        text = str(e).lower()
        for code, needles in _FULL_TEXT.items():
            if any(n in text for n in needles):
                return code
        e = e.__cause__ or e.__context__
    return None


def human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _mount(path: Path) -> Path:
    path = _existing(path)
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def file_size_limit() -> int | None:
    """This process's file size limit (``ulimit -f``) in bytes; None when unlimited."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def room_for(path: Path, need: int, size_now: int = 0, elsewhere: int = 0) -> int | None:
    """ENOSPC (or EFBIG) when writing ``need`` more bytes to ``path`` (now ``size_now`` bytes), and
    ``elsewhere`` bytes to other files on its disk, would not fit the free space (or the file size
    limit); None when it fits."""
    if free_bytes(path) < need + elsewhere:
        return errno.ENOSPC
    limit = file_size_limit()
    if limit is not None and size_now + need > limit:
        return errno.EFBIG
    return None


def disk_full_error(path: Path, code: int, then: str = "", need: int | None = None) -> DiskFullError:
    """One line: what failed (or, given ``need``, would not fit), on which file, the space left there
    (and the file size limit where that is what stopped it), then ``then`` (what was kept, what to do)."""
    path = Path(path)
    where = f"{human(free_bytes(path))} free on {_mount(path)}"
    limit = file_size_limit()
    needs = "" if need is None else f"the next write needs up to {human(need)}; "
    if code == errno.EFBIG and limit is not None:
        what = f"writing {path} would pass this process's file size limit (ulimit -f: {human(limit)}; {needs}{where})"
    elif need is not None and code == errno.ENOSPC:
        what = f"not enough space on the device to go on writing {path} ({needs}{where})"
    else:
        what = f"{_FULL.get(code, os.strerror(code))} writing {path} ({where})"
    return DiskFullError(what + then, code)
