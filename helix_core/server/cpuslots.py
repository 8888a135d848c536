"""A host-wide cap on concurrent decodes, granted earliest deadline first.

One single-threaded decoder per core is the fastest layout (PyAV's threaded decode loses on few cores): a CPU budget
of more worker processes than cores — several DataServers on one host, each with its workers —
would otherwise run them all at once and lose a tenth or more of every core to context switches
and cold caches. And which batch a free core prepares next matters: each DataServer orders its
own queue by deadline, but the ranks wait for the slowest of them, so the host must run the
batch needed soonest across all its servers, or a rank's batch for the next step waits while
another rank's batch for three steps later decodes.

Slots are ``n`` files in /dev/shm named for the cluster, locked with ``flock`` (the kernel drops
the lock of a process that dies, so a killed worker never strands a slot). Workers that wait for a
slot list themselves in a small shared table with their task's deadline key (an absolute
``time.monotonic`` value: CLOCK_MONOTONIC is the same clock in every process of a host); only the
``n`` earliest waiters may take a slot. A waiter blocks in ``select`` on a FIFO of its own (no CPU,
no poll period): whoever releases a slot writes a byte to the FIFOs of the ``n`` earliest waiters
(through write ends it keeps open: a release is a few system calls), which wake at once and try.
(Blocking in ``flock`` would cost no CPU either, but the kernel then wakes waiters in arrival
order, not by deadline.) A holder that dies releases its lock without a word: its DataServer's
supervisor sees the death and calls ``notify``; a waiter also re-checks after ``patience_s``
whatever happened.

The files have one owner: the host's DataServers hold a shared lock on a membership file
(``HostSlots``), and the last one to leave unlinks them — so one server stopping among several
never removes the slots the others' workers use (a respawned worker would re-create them, and
the host's decode cap would double).

/dev/shm is every user's: each file is created with ``O_EXCL`` or else opened with ``O_NOFOLLOW``
and kept only if it is this user's (``_open_own``), so a symlink or file another user planted
under the names is refused, never followed or written; cleanup leaves another user's files.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import select
import stat
import time

import numpy as np

from helix_core.memory.shm import owned

__all__ = ["CpuSlots", "HostSlots", "notify"]

log = logging.getLogger("helix.cpuslots")

_ENTRIES = 128  # waiters a host can list (more wait unranked, after the listed ones)
_ENTRY = np.dtype([("pid", "<i8"), ("key", "<f8"), ("eligible", "<i8")])  # eligible: among the n earliest


def _fifo(shm_dir: str, prefix: str, pid: int) -> str:
    return os.path.join(shm_dir, f"{prefix}w{pid}")


def _open_own(path: str, kind: int = stat.S_IFREG) -> int:
    """Open ``path`` read-write, creating it (``O_EXCL``) if absent; an existing one only if it is
    this user's file of that ``kind`` and not a symlink (``O_NOFOLLOW``). ``PermissionError``
    otherwise: the name was taken by someone else (another user planted it), and nothing was
    written through it."""
    for _ in range(8):  # a file unlinked between the two opens (its last owner left): once more
        try:
            if kind == stat.S_IFREG:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | (os.O_NONBLOCK if kind == stat.S_IFIFO else 0))
        except FileNotFoundError:
            continue
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise PermissionError(
                    f"{path} is a symlink (planted by another user?): refused, not followed"
                ) from None
            raise
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IFMT(st.st_mode) != kind:
            os.close(fd)
            raise PermissionError(f"{path} is not this user's (uid {st.st_uid}, mode {oct(st.st_mode)}): refused")
        return fd
    raise FileNotFoundError(f"{path} kept vanishing while it was opened")


def _table(shm_dir: str, prefix: str) -> tuple[int, mmap.mmap, np.ndarray]:
    fd = _open_own(os.path.join(shm_dir, f"{prefix}q"))
    size = _ENTRIES * _ENTRY.itemsize
    if os.fstat(fd).st_size < size:
        os.posix_fallocate(fd, 0, size)  # zero-filled: every entry empty (pid 0)
    m = mmap.mmap(fd, size)
    return fd, m, np.frombuffer(m, dtype=_ENTRY, count=_ENTRIES)


def _earliest(pids: np.ndarray, keys: np.ndarray, skip: int = 0) -> list[int]:
    """Pids of the listed waiters (except ``skip``), earliest key first (ties: lower pid). The
    table is read without its lock: an entry that changes meanwhile is at most a spare wake-up."""
    listed = [(key, pid) for pid, key in zip(pids.tolist(), keys.tolist()) if pid and pid != skip]
    return [pid for _, pid in sorted(listed)]


class _Doorbells:
    """Write ends of waiters' FIFOs, kept open between wake-ups (opening a FIFO by path costs more
    than the write). A write to a FIFO whose reader is gone fails (``EPIPE``: the waiter died, or
    left and a new process of its pid made a new FIFO), and the path is opened afresh."""

    def __init__(self, shm_dir: str, prefix: str):
        self.shm_dir, self.prefix = shm_dir, prefix
        self._fds: dict[int, int] = {}

    def ring(self, pid: int) -> bool:
        """Wake waiter ``pid``; False when it is gone (its FIFO is not there or has no reader)."""
        for _ in range(2):  # the kept fd, then (if its reader is gone) the path afresh
            fd = self._fds.get(pid)
            if fd is None:
                if len(self._fds) > 2 * _ENTRIES:  # waiters come and go (respawned workers): start over
                    self.close()
                try:
                    fd = os.open(_fifo(self.shm_dir, self.prefix, pid), os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                except OSError:  # gone (it got a slot and left, or died)
                    return False
                st = os.fstat(fd)
                if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid():  # not a waiter of ours
                    os.close(fd)
                    return False
                self._fds[pid] = fd
            try:
                os.write(fd, b"w")
                return True
            except BlockingIOError:  # a full FIFO already holds a wake-up
                return True
            except OSError:  # no reader behind this fd any more
                self._forget(pid)
        return False

    def _forget(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for pid in list(self._fds):
            self._forget(pid)


def _unlink_own(path: str) -> bool:
    """Unlink ``path`` if it is this user's (not a symlink); another user's is left and logged."""
    if not owned(path):
        if os.path.lexists(path):
            log.warning("%s is not this user's: left in place", path)
        return False
    try:
        os.unlink(path)
        return True
    except (FileNotFoundError, PermissionError):
        return False


def _wake(bells: _Doorbells, table: np.ndarray, n: int, skip: int = 0) -> None:
    """Ring the ``n`` earliest listed waiters (except pid ``skip``); one that is gone passes its
    wake-up to the next in line."""
    woken = 0
    for pid in _earliest(table["pid"], table["key"], skip):
        if woken >= n:
            break
        woken += bells.ring(pid)


def notify(prefix: str, n: int, shm_dir: str = "/dev/shm") -> None:
    """Wake the ``n`` earliest waiters of ``prefix`` (say, a holder died: its slot is free)."""
    if not os.path.exists(os.path.join(shm_dir, f"{prefix}q")):
        return
    fd, m, table = _table(shm_dir, prefix)
    bells = _Doorbells(shm_dir, prefix)
    try:
        _wake(bells, table, n)
    finally:
        bells.close()
        del table
        m.close()
        os.close(fd)


def forget(prefix: str, pid: int, shm_dir: str = "/dev/shm") -> None:
    """A waiter died (SIGKILL: it could not delist): drop its entry and unlink its FIFO."""
    _unlink_own(_fifo(shm_dir, prefix, pid))
    if not os.path.exists(os.path.join(shm_dir, f"{prefix}q")):
        return
    fd, m, table = _table(shm_dir, prefix)
    try:
        table["pid"][table["pid"] == pid] = 0
    finally:
        del table
        m.close()
        os.close(fd)


class CpuSlots:
    """``n`` decode slots shared by every process that opens the same ``prefix`` on this host."""

    def __init__(self, prefix: str, n: int, shm_dir: str = "/dev/shm", patience_s: float = 1.0):
        if n < 1:
            raise ValueError(f"CpuSlots(n={n}): need at least one slot")
        self.prefix, self.shm_dir, self.patience_s = prefix, shm_dir, patience_s
        self._pid = os.getpid()
        self._fifo_path = _fifo(shm_dir, prefix, self._pid)
        opened: list[int] = []  # closed again if a name turns out to be another user's (PermissionError)
        try:
            for k in range(n):
                opened.append(_open_own(os.path.join(shm_dir, f"{prefix}{k}")))
            _unlink_own(self._fifo_path)  # a dead process of the same pid left it
            try:
                os.mkfifo(self._fifo_path, 0o600)  # (never follows a symlink: EEXIST)
            except FileExistsError:
                pass  # another user's name there: _open_own refuses it
            self._wakeup = _open_own(self._fifo_path, stat.S_IFIFO)  # read-write: never at EOF
            opened.append(self._wakeup)
            self._qfd, self._map, self._table = _table(shm_dir, prefix)
        except BaseException:
            for fd in opened:
                os.close(fd)
            if len(opened) > n:  # the FIFO was ours
                _unlink_own(self._fifo_path)
            raise
        self._fds = opened[:n]
        self._pids, self._keys, self._eligible = self._table["pid"], self._table["key"], self._table["eligible"]
        self._bells = _Doorbells(shm_dir, prefix)
        self._held: int | None = None
        self._entry: int | None = None
        self._next = self._pid % n  # processes start their search at different slots

    def __len__(self) -> int:
        return len(self._fds)

    # ---- the waiting table ------------------------------------------------------------------------
    def _enlist(self, key: float) -> None:
        fcntl.flock(self._qfd, fcntl.LOCK_EX)
        try:
            pids = self._pids.tolist()
            if 0 in pids:
                k = pids.index(0)
                self._keys[k] = key
                self._eligible[k] = 0
                self._pids[k] = self._pid
                self._entry = k
        finally:
            fcntl.flock(self._qfd, fcntl.LOCK_UN)

    def _delist(self) -> None:
        if self._entry is not None:
            self._pids[self._entry] = 0
            self._entry = None

    def _ahead(self, key: float, verify: bool = True) -> int:
        """How many waiters are ahead of this one (earlier key, ties by pid), counting up to ``n``;
        ``verify``: only live ones (a waiter killed before its supervisor delisted it is dropped)."""
        live, me = 0, self._pid
        for k, (pid, other) in enumerate(zip(self._pids.tolist(), self._keys.tolist())):
            if not pid or pid == me or other > key or (other == key and pid > me):
                continue
            if verify:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:  # a waiter that died: its entry goes
                    if self._pids[k] == pid:
                        self._pids[k] = 0
                    continue
                except PermissionError:
                    pass
            live += 1
            if live >= len(self._fds):
                break
        return live

    # ---- slots ------------------------------------------------------------------------------------------
    def _try(self) -> bool:
        n = len(self._fds)
        for j in range(n):
            k = (self._next + j) % n
            try:
                fcntl.flock(self._fds[k], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            self._held, self._next = k, (k + 1) % n
            return True
        return False

    def _drain(self) -> None:
        try:  # one read: wake-ups are a byte each, and a waiter is rung a few times at most
            os.read(self._wakeup, 256)
        except BlockingIOError:
            pass

    def acquire(self, key: float | None = None, stop=lambda: False, watch=()) -> bool:
        """Take a slot for a task whose deadline key is ``key`` (None: now), blocking; False if
        ``stop()`` turned true first (it is checked before the first wait, when a file descriptor
        of ``watch`` becomes readable, and every ``patience_s`` — not on every wake-up: a wake-up
        is a slot to try for, and a stop signals itself through ``watch``)."""
        if self._held is not None:
            return True
        key = time.monotonic() if key is None else float(key)
        self._enlist(key)
        check = True  # the first pass, and after a timeout: stop() is asked and the waiters ahead checked alive
        try:
            while True:
                self._drain()  # before trying: a release after the try leaves a byte that wakes us
                eligible = self._ahead(key, verify=check) < len(self._fds)
                if self._entry is not None:
                    self._eligible[self._entry] = int(eligible)
                if eligible and self._try():
                    return True
                if check and stop():
                    return False
                ready = select.select([self._wakeup, *watch], [], [], self.patience_s)[0]
                check = not ready or any(fd in ready for fd in watch)
        finally:
            self._delist()

    def release(self) -> None:
        if self._held is not None:
            fcntl.flock(self._fds[self._held], fcntl.LOCK_UN)
            self._held = None
            _wake(self._bells, self._table, len(self._fds), skip=self._pid)

    def close(self) -> None:
        self.release()
        self._delist()
        self._bells.close()
        del self._table, self._pids, self._keys, self._eligible
        self._map.close()
        for fd in (*self._fds, self._qfd, self._wakeup):
            os.close(fd)
        self._fds = []
        _unlink_own(self._fifo_path)


class HostSlots:
    """A DataServer's membership of its host's decode slots: a shared ``flock`` on the
    ``{prefix}m`` file for as long as it lives (the kernel drops it if the process dies). ``close``
    unlinks the slot files only when no other member is left."""

    def __init__(self, prefix: str, shm_dir: str = "/dev/shm"):
        self.prefix, self.shm_dir = prefix, shm_dir
        self._path = os.path.join(shm_dir, f"{prefix}m")
        while True:
            fd = _open_own(self._path)
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a last member is unlinking
            try:
                if os.stat(self._path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # unlinked under us: join the next generation of files
        self._fd: int | None = fd

    def close(self) -> bool:
        """Leave; unlink the host's slot files if this was the last member. True if it did."""
        if self._fd is None:
            return False
        fd, self._fd = self._fd, None
        last = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # upgrade: only when no one else holds it
            last = True
        except BlockingIOError:
            pass
        if last:
            for name in os.listdir(self.shm_dir):
                if name.startswith(self.prefix) and name != os.path.basename(self._path):
                    _unlink_own(os.path.join(self.shm_dir, name))  # (another user's is left, logged)
            _unlink_own(self._path)  # last: a server that opened it meanwhile sees another inode and retries
        os.close(fd)
        return last
