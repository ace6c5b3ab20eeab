"""Files under an nvme root, opened so that nothing planted in the root can redirect them.

Trust model: the path up to and including ``root`` is the operator's (it comes from the
configuration, and a symbolic link in it is followed like in any configured path).
``root`` and every store directory in it must belong to this process's user and must
not be writable by group or others; inside ``root`` nothing is followed: a store
directory is opened relative to ``root``'s descriptor and every file relative to its
store directory's, all with ``O_NOFOLLOW``; a file must be a regular file of this user;
a temporary file is created with ``O_EXCL`` (a leftover, or a link planted in its place,
is unlinked first, which never touches what a link points to). Directories created here
are 0700 and files 0600 whatever the umask. A path that fails a check raises
:class:`UnsafeStore`, naming it and why; other failures are the ``OSError`` the caller
wraps.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tiered_kv.errors import UnsafeStore
from tiered_kv.zeroed import zeroed_array

OWNER_DIR = 0o700
OWNER_FILE = 0o600
_NO_LINKS = os.O_CLOEXEC | os.O_NOFOLLOW
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NO_LINKS
_TIER = "nvme"


def _unsafe(path: str, reason: str) -> UnsafeStore:
    return UnsafeStore(path, reason, tier=_TIER)


def check_safe(fd: int, path: str, *, directory: bool, owner: bool) -> os.stat_result:
    """The ``fstat`` of ``fd``, once it is a directory (or a regular file) that group and
    others cannot write, and that this user owns (when ``owner``: a read-only inspection
    may look at another user's store, whose owner is that user's to check)."""
    st = os.fstat(fd)
    if directory and not stat.S_ISDIR(st.st_mode):
        raise _unsafe(path, "is not a directory")
    if not directory and not stat.S_ISREG(st.st_mode):
        raise _unsafe(path, "is not a regular file")
    if owner and st.st_uid != os.geteuid():
        raise _unsafe(path, f"is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _unsafe(path, f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")
    return st


def _open_below(dir_fd: int, name: str, path: str, flags: int, mode: int = OWNER_FILE) -> int:
    """``open(name, flags | O_NOFOLLOW)`` relative to ``dir_fd``; a link is refused."""
    try:
        return os.open(name, flags | _NO_LINKS, mode, dir_fd=dir_fd)
    except OSError as exc:
        # A link is ELOOP, or ENOTDIR when a directory was asked for.
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        link = stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
        raise _unsafe(path, "is a symbolic link" if link else "is not a directory") from exc


def _mkdir(dir_fd: int, name: str) -> bool:
    """Create directory ``name`` (0700 once opened) below ``dir_fd``; whether this call made it."""
    try:
        os.mkdir(name, OWNER_DIR, dir_fd=dir_fd)
    except FileExistsError:
        return False
    return True


def open_root(root: Path) -> int:
    """A descriptor of directory ``root``, created 0700 with its missing parents when
    absent; :class:`UnsafeStore` unless it is this user's and only this user's to write."""
    missing: list[str] = []
    existing = root
    while not existing.exists() and existing != existing.parent:
        missing.append(existing.name)
        existing = existing.parent
    fd = os.open(existing, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's path: followed
    try:
        path = existing
        for name in reversed(missing):
            path = path / name
            created = _mkdir(fd, name)
            child = _open_below(fd, name, str(path), _DIR_FLAGS)
            os.close(fd)
            fd = child
            if created:
                os.fchmod(fd, OWNER_DIR)
        check_safe(fd, str(root), directory=True, owner=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_store_dir(root_fd: int, name: str, path: str) -> int:
    """A descriptor of store directory ``name`` in the root open as ``root_fd``, created
    when absent; it must be this user's, not a link, and not writable by group or others,
    and is made 0700."""
    _mkdir(root_fd, name)
    fd = _open_below(root_fd, name, path, _DIR_FLAGS)
    try:
        st = check_safe(fd, path, directory=True, owner=True)
        if stat.S_IMODE(st.st_mode) != OWNER_DIR:
            os.fchmod(fd, OWNER_DIR)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_subdir(dir_fd: int, name: str, path: str) -> int:
    """Directory ``name`` below ``dir_fd``, for reading only (inspection): not followed
    if it is a link, whoever owns it."""
    return _open_below(dir_fd, name, path, _DIR_FLAGS)


def open_file(dir_fd: int, name: str, path: str, flags: int, *, owner: bool = True) -> int:
    """File ``name`` of the directory open as ``dir_fd``: not a link, a regular file, this
    user's (when ``owner``; a read-only inspection may be someone else's). Opened for
    writing it is made 0600; ``O_CREAT`` creates it 0600."""
    fd = _open_below(dir_fd, name, path, flags | os.O_NONBLOCK)  # a planted FIFO must not block the open
    try:
        st = check_safe(fd, path, directory=False, owner=owner)
        os.set_blocking(fd, True)
        if flags & (os.O_WRONLY | os.O_RDWR) and stat.S_IMODE(st.st_mode) != OWNER_FILE:
            os.fchmod(fd, OWNER_FILE)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: Bytes moved per system call: a file of any size is read and written in pieces, so
#: that no single step holds the interpreter for long.
PIECE_BYTES = 1 << 20


def read_file(dir_fd: int, name: str, path: str, *, owner: bool = True) -> memoryview:
    """The whole content of file ``name`` (see :func:`open_file`), read in pieces into
    one buffer. The buffer is not cleared first (zeroing the 24 MB checkpoint of a
    million slots held the interpreter, and so the event loop, for 10 ms): it is mapped
    zero pages, touched by the read (see :func:`~tiered_kv.zeroed.zeroed_array`)."""
    fd = open_file(dir_fd, name, path, os.O_RDONLY, owner=owner)
    try:
        view = zeroed_array(os.fstat(fd).st_size, np.uint8).data
        done = 0
        while done < len(view) and (got := os.readv(fd, [view[done : done + PIECE_BYTES]])):
            done += got
        return view[:done]  # the file shrank meanwhile
    finally:
        os.close(fd)


def replace_file(
    dir_fd: int, name: str, data: bytes | memoryview | Sequence[bytes | memoryview], path: str, *, tmp: str
) -> None:
    """Make ``data`` (one buffer, or several in order) the content of file ``name``
    (0600) all at once, also across a crash: written to a new file ``tmp``
    (``O_EXCL``), synced, renamed over ``name``, then the directory synced. ``tmp`` is
    the caller's alone (it holds a lock that says so)."""
    parts = [data] if isinstance(data, bytes | memoryview) else data
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_LINKS
    try:
        fd = os.open(tmp, flags, OWNER_FILE, dir_fd=dir_fd)
    except FileExistsError:  # left by a crash, or planted: unlinking it follows nothing
        os.unlink(tmp, dir_fd=dir_fd)
        fd = os.open(tmp, flags, OWNER_FILE, dir_fd=dir_fd)
    try:
        os.fchmod(fd, OWNER_FILE)
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view[:PIECE_BYTES]) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)
