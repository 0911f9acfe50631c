"""Segment names: who owns a shared-memory object, encoded in its name so a survivor can tell leaks apart.

A name is "/llmdd.<uid>.<pid>.<start_ticks>.<16 random hex digits>". The start ticks pin the owner across
PID reuse: a live process with the right pid but other start ticks is another process; the owner is dead.
Nothing here touches shared memory; it only builds, parses and judges names.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from dataclasses import dataclass

import psutil

from .errors import ProcessGone

NAME_PREFIX = "llmdd"

# POSIX NAME_MAX for the file under /dev/shm; ours stay well below it (< 80 chars with 64-bit numbers).
_NAME_MAX = 255

_NAME_RE = re.compile(
    r"/?" + re.escape(NAME_PREFIX) + r"\.(0|[1-9][0-9]*)\.([1-9][0-9]*)\.(0|[1-9][0-9]*)\.[0-9a-f]{16}"
)

# (pid, start_ticks) of this process; keyed by pid so a forked child recomputes its own.
_own_ticks: tuple[int, int] | None = None


@dataclass(frozen=True)
class SegmentOwner:
    """The process that created a segment, as its name records it."""

    uid: int
    pid: int
    start_ticks: int


def process_start_ticks(pid: int) -> int:
    """Start time of process `pid` in clock ticks since boot; `ProcessGone` if there is no such process.

    Stable for the life of a process and different after PID reuse. On Linux it is field 22 of
    /proc/<pid>/stat, read directly rather than psutil's create_time(): that one adds the boot time in
    wall-clock seconds, which the kernel recomputes from the current clock, so an NTP step would shift every
    owner's ticks and make the reaper unlink live segments. Elsewhere, psutil's create_time() in 1/100 s.
    """
    if pid <= 0:
        raise ProcessGone(f"no process with pid {pid}")
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat_file:
                stat = stat_file.read()
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(f"no process with pid {pid}") from exc
        # The command name (field 2) may hold spaces and parentheses; fields after the last ")" are plain.
        fields = stat[stat.rindex(b")") + 2 :].split()
        return int(fields[19])  # field 22 overall: starttime
    try:
        return round(psutil.Process(pid).create_time() * 100)
    except psutil.NoSuchProcess as exc:
        raise ProcessGone(f"no process with pid {pid}") from exc


def _own_start_ticks() -> int:
    global _own_ticks
    pid = os.getpid()
    if _own_ticks is None or _own_ticks[0] != pid:
        _own_ticks = (pid, process_start_ticks(pid))
    return _own_ticks[1]


def own_owner() -> SegmentOwner:
    """The owner this process's segment names record."""
    return SegmentOwner(uid=os.getuid(), pid=os.getpid(), start_ticks=_own_start_ticks())


def make_segment_name() -> str:
    """A fresh name for a segment owned by the calling process (random, so effectively never reused)."""
    name = f"/{NAME_PREFIX}.{os.getuid()}.{os.getpid()}.{_own_start_ticks()}.{secrets.token_hex(8)}"
    assert len(name) - 1 <= _NAME_MAX
    return name


def parse_segment_name(name: str) -> SegmentOwner | None:
    """The owner recorded in one of our names (with or without the leading "/"); None for any other name."""
    match = _NAME_RE.fullmatch(name)
    if match is None:
        return None
    return SegmentOwner(uid=int(match[1]), pid=int(match[2]), start_ticks=int(match[3]))


def owner_alive(owner: SegmentOwner) -> bool:
    """True while the owner runs: its pid exists, is not a zombie, and started at the recorded ticks."""
    try:
        if psutil.Process(owner.pid).status() == psutil.STATUS_ZOMBIE:
            return False
        return process_start_ticks(owner.pid) == owner.start_ticks
    except (psutil.NoSuchProcess, ProcessGone, ValueError):
        # ValueError: psutil refuses negative pids; such a name cannot belong to a live process.
        return False
