"""How the node cache creates and opens its files without leaving its directory.

Everything in the cache has a name anyone can compute (a hash of the URL), and a cache
directory may be shared. A symlink planted at such a name (by another user, or left by a
misconfiguration) must never make the cache write, or read, the file it points to:

- files are created and opened with ``O_NOFOLLOW`` (a symlink there is refused);
- small files written whole (metadata, member tables, counters) go to a fresh temporary name
  (random, created with ``O_EXCL``) and are renamed into place;
- the cache's subdirectories must be real directories, not symlinks (:func:`check_directory`),
  and the very directories first checked: :func:`check_directory` is given what it found then
  (another user may swap one for a symlink later), and renames go through a descriptor of the
  directory checked (:func:`open_directory`), which a swap cannot redirect.

Hand-written because ``tempfile`` offers no "open this exact name, never through a symlink",
and its ``mkstemp`` ignores the umask (0600).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

from cloudshards.errors import CacheError

__all__ = [
    "DirectoryId",
    "check_directory",
    "open_directory",
    "open_file",
    "replace_with",
    "unlink_partial",
]

#: A directory's identity: (st_dev, st_ino).
DirectoryId = tuple[int, int]

#: Refuses a symlink as the last component (0 where the platform has no such flag).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def open_file(path: str, flags: int, mode: int = 0o644, *, dir_fd: int | None = None) -> int:
    """``os.open`` of a regular file only: a symlink at ``path`` is refused, and so is a
    directory, FIFO or device planted there (a FIFO would hold the open, or a read, forever).
    With ``dir_fd``, only the base name of ``path`` is opened, in that directory.

    Raises:
        CacheError: ``path`` is a symlink or not a regular file (an ``OSError``).
        OSError: As ``os.open`` raises it (a missing file, a full disk, ...).
    """
    # O_NONBLOCK: opening a FIFO returns at once (a regular file's reads ignore the flag).
    extra = _NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        if dir_fd is None:
            fd = os.open(path, flags | extra, mode)
        else:
            fd = os.open(os.path.basename(path), flags | extra, mode, dir_fd=dir_fd)
    except OSError as exc:
        # A symlink; a FIFO no one reads; a directory opened for writing.
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise CacheError(f"{path} is not a regular file: refused, never followed") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CacheError(f"{path} is not a regular file (a directory, FIFO or device): refused")
    return fd


def inode_at(path: str) -> int | None:
    """The inode of the file at ``path``; None when there is none."""
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def replace_with(path: str, data: bytes) -> None:
    """Write ``data`` to a new temporary file beside ``path``, then rename it over ``path``
    (readers see the old file or the new one, whole). Raises ``OSError``; leaves nothing.

    Raises:
        CacheError: The directory of ``path`` is a symlink now (swapped in by another user of
            a shared cache), or not a directory.
    """
    directory, base = os.path.split(path)
    check_directory(directory)  # written later too (a member table): check it again here
    # A fresh random name, created exclusively (as mkstemp does, but with the umask's mode,
    # like the cache's data files, not mkstemp's 0600).
    tmp = os.path.join(directory, f".{base}.{secrets.token_hex(8)}.tmp")
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_directory(path: str, expected: DirectoryId | None = None) -> DirectoryId:
    """Raise :class:`~cloudshards.errors.CacheError` unless ``path`` is a real directory (and,
    given ``expected``, the same one as when it was first checked): a symlink in its place
    would take every file written there out of the cache.

    Returns:
        The directory's identity, to pass as ``expected`` later.
    """
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise CacheError(
            f"cache directory {path} is {kind}: refusing to write through it (remove it, or "
            "use another cache_dir)"
        )
    found = (info.st_dev, info.st_ino)
    if expected is not None and found != expected:
        raise CacheError(
            f"cache directory {path} was replaced by another directory since this process "
            "checked it: refusing to write through it (use a cache_dir only you can write)"
        )
    return found


def open_directory(path: str, expected: DirectoryId) -> int:
    """A descriptor of the directory at ``path``, which must be the one ``expected`` names
    (never a symlink): names resolved against it (``dir_fd=``) stay in that directory
    whatever is renamed or swapped at ``path`` afterwards.

    Raises:
        CacheError: ``path`` is a symlink, not a directory, or another directory.
        OSError: As ``os.open`` raises it (a missing directory, ...).
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            check_directory(path, expected)  # names what is there instead
        raise
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) != expected:
        os.close(fd)
        check_directory(path, expected)  # raises, naming it
        raise CacheError(f"cache directory {path} changed while it was opened: refused")
    return fd


def unlink_partial(partial: str, *, dir_fd: int | None = None) -> None:
    """Remove a dead download's partial file (the lock is ours), so that this one writes a new
    file: the old one's followers keep what they read from it and notice (FollowStream).
    With ``dir_fd``, only the base name of ``partial`` is removed, from that directory.

    Raises:
        CacheError: A directory sits at its name (an ``OSError``).
    """
    try:
        if dir_fd is None:
            os.unlink(partial)
        else:
            os.unlink(os.path.basename(partial), dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError as exc:
        raise CacheError(f"{partial} is not a regular file (a directory): refused") from exc
