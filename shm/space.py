"""What the tmpfs behind /dev/shm can still back, and the error that says so when it cannot.

Rules: every figure is measured when asked (one statvfs: other processes fill and empty the same mount), so a
check is advisory and the page population after it can still fail; both raise `SharedMemoryExhausted` built
here, naming the directory, the bytes needed and free, the mount, and how to make it larger. Reads
/proc/self/mounts only to build that message, never on the way to a success.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass

from .errors import SharedMemoryExhausted
from .reaper import SHM_DIR

__all__ = ["ShmSpace", "check_space", "exhausted", "format_nbytes", "raise_hint", "shm_space"]

_GIB = 1 << 30
_MIB = 1 << 20


@dataclass(frozen=True)
class ShmSpace:
    """The size of the file system under `directory` and what an unprivileged user may still put there."""

    directory: str
    size_nbytes: int
    free_nbytes: int

    @property
    def used_nbytes(self) -> int:
        return self.size_nbytes - self.free_nbytes


def shm_space(directory: str = SHM_DIR) -> ShmSpace:
    """statvfs of `directory` (free: the blocks available to an unprivileged user, as tmpfs counts them)."""
    info = os.statvfs(directory)
    return ShmSpace(directory, info.f_blocks * info.f_frsize, info.f_bavail * info.f_frsize)


def format_nbytes(nbytes: int) -> str:
    """`1.5 GiB`, `63.9 MiB`, `12.0 KiB`, `7 bytes`."""
    for unit, scale in (("GiB", _GIB), ("MiB", _MIB), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _mount_point(directory: str) -> tuple[str, str]:
    """(mount point, file system type) of the mount that holds `directory`; (directory, "?") if unknown."""
    path = os.path.realpath(directory)
    best, fstype = "", "?"
    with (
        contextlib.suppress(OSError),
        open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts,
    ):
        for line in mounts:
            fields = line.split()
            if len(fields) < 3:
                continue
            # Mount points escape spaces and the like as octal (\040); ours never need them decoded.
            point = fields[1]
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, fstype = point, fields[2]
    return (best or directory), fstype


def raise_hint(size_nbytes: int, directory: str = SHM_DIR) -> str:
    """How to give the mount under `directory` at least `size_nbytes` in all: a container's size option
    and, as root, a remount."""
    point, _ = _mount_point(directory)
    if size_nbytes > _GIB:
        gib = -(-size_nbytes // _GIB)
        at_least, docker, mount = f"{gib} GiB", f"{gib}g", f"{gib}G"
    else:
        mib = -(-size_nbytes // (64 * _MIB)) * 64
        at_least, docker, mount = f"{mib} MiB", f"{mib}m", f"{mib}M"
    return (
        f"give it at least {at_least}: `--shm-size={docker}` for a container (docker or podman run; "
        f"`shm_size:` in compose; in Kubernetes an emptyDir of medium Memory at {point}), or as root "
        f"`mount -o remount,size={mount} {point}`"
    )


def exhausted(needed_nbytes: int, what: str, *, error: int | None = None) -> SharedMemoryExhausted:
    """The error for `needed_nbytes` more bytes of `what` that the mount under /dev/shm cannot back, with
    the figures measured now; `error` is the errno of a population that failed (None: refused before)."""
    try:
        space = shm_space()
    except OSError:
        space = ShmSpace(SHM_DIR, 0, 0)
    point, fstype = _mount_point(SHM_DIR)
    needed = f"{format_nbytes(needed_nbytes)} ({needed_nbytes} bytes)"
    free = (
        f"{format_nbytes(space.free_nbytes)} ({space.free_nbytes} bytes) free of "
        f"{format_nbytes(space.size_nbytes)} ({fstype} mounted at {point})"
    )
    if error == errno.ENOMEM and space.free_nbytes >= needed_nbytes:
        # The mount had room: the memory itself ran out (a cgroup's limit counts /dev/shm pages too).
        message = (
            f"{space.directory} has {free}, but the kernel found no memory to back {needed} more for {what}"
            " (ENOMEM): this host or container is out of memory; free some, or raise the container's "
            "memory limit"
        )
    else:
        failed = f" ({os.strerror(error)} when populating the pages)" if error is not None else ""
        message = (
            f"{space.directory} cannot back {needed} more for {what}{failed}: it has {free}; "
            + raise_hint(space.used_nbytes + needed_nbytes)
        )
    return SharedMemoryExhausted(
        message,
        needed_nbytes=needed_nbytes,
        free_nbytes=space.free_nbytes,
        size_nbytes=space.size_nbytes,
        directory=space.directory,
        error=error,
    )


def check_space(needed_nbytes: int, what: str) -> None:
    """Raise `exhausted(...)` when the mount under /dev/shm has fewer than `needed_nbytes` free now."""
    if needed_nbytes > 0 and needed_nbytes > shm_space().free_nbytes:
        raise exhausted(needed_nbytes, what)
