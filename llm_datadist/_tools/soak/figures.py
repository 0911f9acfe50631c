"""The soak's figures of a process: what one sample says, how it is read, and the rules that judge them.

Rules: a sample reads /proc and psutil only, never stops or asks the process, so the driver takes one every
few seconds while the churn runs (a `Series`). Each figure is judged at the quiescent checkpoints (`Rule`:
the last against the first) and, for memory, by its trend through the run (`trend`); the reasons for
every tolerance and bound are in docs/soak.md.
"""

from __future__ import annotations

import contextlib
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from llm_datadist._shm.names import parse_segment_name

from .spec import PORT_RANGE
from .trend import Trend, TrendRule, judge

MIB = 1 << 20
# Tolerances, the reasons for them in docs/soak.md: RSS may wander by what glibc and pymalloc keep for
# reuse; everything else counts objects the library owns and must be back where it was.
RSS_TOLERANCE_NBYTES = 24 << 20
# Memory may grow no faster than this, judged over the samples after the first third of the churn (at
# least 3 minutes in), once they span 10 minutes: docs/soak.md says why (weeks of uptime) and what a run
# of a given length can tell.
MEMORY_TREND = TrendRule(max_per_h=4.0 * MIB, min_window_s=600.0, skip_fraction=1 / 3, min_skip_s=180.0)
# The trend of the other figures is shown, never judged: their rule is exactness at the checkpoints.
SHOWN_TREND = TrendRule(max_per_h=float("inf"), min_window_s=0.0, skip_fraction=1 / 3, min_skip_s=180.0)


@dataclass(frozen=True)
class Figures:
    rss_nbytes: int
    anon_nbytes: int  # the anonymous part of RSS (heap, stacks): where a leak grows
    fds: int
    threads: int
    shm_live_nbytes: int  # /dev/shm files mapped that still exist
    shm_deleted_nbytes: int  # /dev/shm files mapped after they were unlinked
    segments: int  # /dev/shm entries this process created (its pid in the name)
    fd_kinds: tuple[str, ...] = ()  # what each fd is ("socket", "pipe", a path...), to explain a change
    # Across hosts: the transfer engines' TCP connections (Mooncake pools up to 4 a peer engine), counted
    # apart from the fds that are ours; of those, the ones to engines that are gone (CLOSE_WAIT: the peer
    # closed its end, ours is still open).
    engine_sockets: int = 0
    stale_engine_sockets: int = 0

    @property
    def own_fds(self) -> int:
        return self.fds - self.engine_sockets


def segment_pid(name: str) -> int | None:
    owner = parse_segment_name(name)
    return None if owner is None else owner.pid


def shm_entries() -> list[str]:
    try:
        return os.listdir("/dev/shm")
    except FileNotFoundError:
        return []


def _anon_nbytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def sample(pid: int, entries: list[str], *, engine_sockets: bool) -> Figures:
    """The figures of `pid` now; `entries` is a listing of /dev/shm (one for all processes sampled at once);
    `engine_sockets`: read the transfer engine's connections too (--hosts; reading the TCP tables is most of
    a sample's cost, and on one host no engine runs). Raises psutil.Error or OSError when the process is
    gone."""
    process = psutil.Process(pid)
    with process.oneshot():
        rss, fds, threads = process.memory_info().rss, process.num_fds(), process.num_threads()
    live = deleted = 0
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/dev/shm/"):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if parts[5].rstrip("\n").endswith(" (deleted)"):
                deleted += end - start
            else:
                live += end - start
    segments = sum(1 for name in entries if segment_pid(name) == pid)
    engine, stale = _engine_sockets(pid) if engine_sockets else (0, 0)
    anon = _anon_nbytes(pid)
    return Figures(rss, anon, fds, threads, live, deleted, segments, _fd_kinds(pid), engine, stale)


_TCP_CLOSE_WAIT = "08"  # the state column of /proc/net/tcp


def _engine_sockets(pid: int) -> tuple[int, int]:
    """The connected TCP sockets of `pid` with neither end on one of the soak's listen ports: the transfer
    engine's connections (our links always have an owner's listen port at one end); and of those, the ones
    in CLOSE_WAIT (the peer engine went and our end is still open). Read from the tables of the
    process's own network namespace; (0, 0) on one host, where no engine runs."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    engine = stale = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}", encoding="ascii") as lines:
            next(lines, None)  # the header
            for line in lines:
                fields = line.split()
                ports = [int(field.rsplit(":", 1)[1], 16) for field in fields[1:3]]
                if fields[9] not in inodes or ports[1] == 0:  # not ours, or a listener
                    continue
                if not any(PORT_RANGE[0] <= port <= PORT_RANGE[1] for port in ports):
                    engine += 1
                    stale += fields[3] == _TCP_CLOSE_WAIT
    return engine, stale


def _fd_kinds(pid: int) -> tuple[str, ...]:
    kinds = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                kinds.append(target.split(":[")[0] if ":[" in target else target)
    return tuple(sorted(kinds))


@dataclass(frozen=True)
class Rule:
    title: str
    attribute: str
    unit: int  # divide by this to print
    tolerance: int  # end may exceed start by this much
    exact: bool = False  # end must equal start (a drop is as telling as a rise: a thread died, a link went)
    zero: bool = False  # 0 at both checkpoints (a retired segment must not stay mapped, contract 7)
    trend: TrendRule = SHOWN_TREND  # how its samples through the run are judged


RULES = (
    # RSS is anon + files + /dev/shm pages touched; the last swing by hundreds of MiB in a v1 process as
    # its pool and its peers' grow and shrink, so the rate bound is on the anonymous part, where leaks are.
    Rule("RSS MiB", "rss_nbytes", MIB, RSS_TOLERANCE_NBYTES),
    Rule("anon MiB", "anon_nbytes", MIB, RSS_TOLERANCE_NBYTES, trend=MEMORY_TREND),
    Rule("fds", "own_fds", 1, 0, exact=True),
    Rule("threads", "threads", 1, 0, exact=True),
    Rule("shm live MiB", "shm_live_nbytes", MIB, 0),
    Rule("shm del MiB", "shm_deleted_nbytes", MIB, 0, zero=True),
    Rule("own segs", "segments", 1, 0),
)
# Across hosts: the engines' connections, no more at the end than at the start (a peer engine's pool is
# opened by the warm-up's pulls), and none to an engine that is gone, at either checkpoint (docs/soak.md).
ENGINE_SOCKETS = Rule("engine conns", "engine_sockets", 1, 0)
STALE_ENGINE_SOCKETS = Rule("stale conns", "stale_engine_sockets", 1, 0, zero=True)
HOST_RULES = (ENGINE_SOCKETS, STALE_ENGINE_SOCKETS)


def value(figures: Figures, attribute: str) -> int:
    return int(getattr(figures, attribute))


def is_flat(rule: Rule, start: Figures, end: Figures) -> bool:
    """The checkpoint rule: the end's figure against the start's."""
    a, b = value(start, rule.attribute), value(end, rule.attribute)
    if rule.zero:
        return a == 0 and b == 0
    return b == a if rule.exact else b <= a + rule.tolerance


class Series:
    """One process's samples through the churn, kept compact (8 bytes a figure: a long run's driver must
    not grow by what it measures): seconds since the churn began, and each rule's figure."""

    ATTRIBUTES = tuple(dict.fromkeys(r.attribute for r in (*RULES, *HOST_RULES)))

    def __init__(self) -> None:
        self.times_s = array("d")
        self._values = {name: array("q") for name in self.ATTRIBUTES}

    def __len__(self) -> int:
        return len(self.times_s)

    def add(self, at_s: float, figures: Figures) -> None:
        self.times_s.append(at_s)
        for name, values in self._values.items():
            values.append(value(figures, name))

    def values(self, attribute: str) -> array[int]:
        return self._values[attribute]

    def trend(self, rule: Rule, churn_s: float) -> Trend:
        return judge(rule.trend, self.times_s, self._values[rule.attribute], churn_s)

    def growth(self, attribute: str, span: int = 6) -> tuple[float, float] | None:
        """(baseline, now): the medians of the first and of the latest `span` samples, None before there are
        `span`. Medians, so that one sample taken while many buffers were live is not called growth."""
        values = self._values[attribute]
        if len(values) < span:
            return None
        return _median(values[:span]), _median(values[-span:])


def _median(values: Sequence[int]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
