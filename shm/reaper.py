"""Finds the segments our processes left behind and unlinks those whose owner is dead.

Only names that `names.parse_segment_name` accepts, recorded for this uid and owned by it on disk, are
considered; a segment is reaped only when its owner (pid + start ticks) no longer runs. Races with other
reapers and with owners unlinking are expected: a segment that vanished is simply skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .names import SegmentOwner, own_owner, owner_alive, parse_segment_name

__all__ = ["SHM_DIR", "SegmentInfo", "list_segments", "reap", "unlink_own"]

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SegmentInfo:
    """One of our segments as found in the shared-memory directory."""

    name: str  # with the leading "/"
    owner: SegmentOwner
    nbytes: int
    alive: bool


def list_segments(*, uid: int | None = None, shm_dir: str = SHM_DIR) -> list[SegmentInfo]:
    """Our segments of user `uid` (default: the current uid), sorted by name.

    A name must parse, record `uid`, and its file must belong to `uid`: another user can create a file that
    carries our uid in its name, and it is not ours to judge.
    """
    if uid is None:
        uid = os.getuid()
    infos = []
    for entry in sorted(os.listdir(shm_dir)):
        owner = parse_segment_name(entry)
        if owner is None or owner.uid != uid:
            continue
        try:
            stat = os.stat(os.path.join(shm_dir, entry), follow_symlinks=False)
        except FileNotFoundError:
            continue  # unlinked since listdir
        if stat.st_uid != uid:
            continue
        infos.append(
            SegmentInfo(name="/" + entry, owner=owner, nbytes=stat.st_size, alive=owner_alive(owner))
        )
    return infos


def reap(*, uid: int | None = None, pid: int | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments of user `uid` (default: the current uid) whose owner is dead (and is `pid`, if
    given); the names unlinked.

    Names carry a random part, so a dead owner's name can never be reused by a live process: unlinking it
    cannot hit a segment someone still expects to create. Mappings of a reaped segment stay valid.
    """
    reaped = []
    for info in list_segments(uid=uid, shm_dir=shm_dir):
        if info.alive or (pid is not None and info.owner.pid != pid):
            continue
        try:
            os.unlink(os.path.join(shm_dir, info.name[1:]))
        except FileNotFoundError:
            continue  # another reaper, or the owner on its way out, was first
        reaped.append(info.name)
    return reaped


def unlink_own(*, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every segment this process created; the names unlinked. The last resort of a process about
    to die without its clean-up (mappings, here and in peers, stay valid until unmapped)."""
    me = own_owner()
    unlinked = []
    for info in list_segments(uid=me.uid, shm_dir=shm_dir):
        if info.owner != me:
            continue
        try:
            os.unlink(os.path.join(shm_dir, info.name[1:]))
        except FileNotFoundError:
            continue
        unlinked.append(info.name)
    return unlinked
