"""`llm-datadist soak --debug-memory S` (hidden): a child dumps where its memory goes to its log every S s.

Rules: for finding what grows, not for verdicts (tracemalloc slows every allocation). Each dump says the
resident anonymous memory, glibc's view of its heap (`mallinfo2`: bytes in use against bytes free but
kept), the gc-tracked objects by type and tracemalloc's top lines, both against the first dump; the last
dump (at stop) also trims the heap (`malloc_trim(0)`) and says what that gave back.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from typing import TextIO

TRACE_FRAMES = 3  # enough to see who calls the line that grows; more slows every allocation further
TOP_LINES = 15
TOP_TYPES = 12


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # bytes of the main heap and the other arenas (not mmapped chunks)
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in mmapped chunks
            "usmblks",
            "fsmblks",
            "uordblks",  # bytes in use
            "fordblks",  # bytes free, kept by the allocator
            "keepcost",
        )
    ]


def _libc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL("libc.so.6")
        if hasattr(libc, "mallinfo2") and hasattr(libc, "malloc_trim"):
            libc.mallinfo2.restype = _MallInfo2
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            return libc
    return None


def settle_heap() -> None:
    """Collect cycles and give the heap glibc keeps free back to the system (`malloc_trim(0)`, every
    arena), so that a checkpoint compares live memory, not what the allocator happened to keep: its level
    moves by tens of MiB with the sizes the last pulls allocated (docs/soak.md)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_kib() -> dict[str, int]:
    wanted = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads")
    values: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in wanted:
                values[name] = int(rest.split()[0])
    return values


class MemoryProbe:
    """Dumps to `out` every `interval_s` from a daemon thread; `final()` dumps once more and trims."""

    def __init__(self, label: str, interval_s: float, out: TextIO = sys.stderr) -> None:
        self.label = label
        self.interval_s = interval_s
        self.out = out
        self.t0 = time.monotonic()
        self.libc = _libc()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        tracemalloc.start(TRACE_FRAMES)
        # The first snapshot waits on disk: alive, its traces (tuples) would count as grown gc objects.
        fd, self.first_snapshot = tempfile.mkstemp(prefix="llmdd-soak-tracemalloc-")
        os.close(fd)
        self.has_first = False
        self.first_types: Counter[str] | None = None
        self._thread = threading.Thread(target=self._loop, name="soak-memory-probe", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.dump()

    def _print(self, text: str) -> None:
        print(f"[memory {self.label} {time.monotonic() - self.t0:7.1f} s] {text}", file=self.out, flush=True)

    def dump(self, *, trim: bool = False) -> None:
        with self._lock:
            status = _status_kib()
            head = " ".join(f"{k} {v / 1024:.1f} MiB" for k, v in status.items() if k != "Threads")
            self._print(f"{head}, threads {status.get('Threads')}")
            if self.libc is not None:
                info = self.libc.mallinfo2()
                self._print(
                    f"malloc: heap {info.arena / 2**20:.1f} MiB (in use {info.uordblks / 2**20:.1f}, free "
                    f"{info.fordblks / 2**20:.1f}), mmapped {info.hblkhd / 2**20:.1f} MiB in {info.hblks}"
                )
            traced, peak = tracemalloc.get_traced_memory()
            self._print(f"tracemalloc: {traced / 2**20:.2f} MiB traced (peak {peak / 2**20:.1f})")
            types = Counter(type(o).__qualname__ for o in gc.get_objects())
            if self.first_types is None:
                self.first_types = types
            grown = (types - self.first_types).most_common(TOP_TYPES)
            self._print(
                f"gc objects: {sum(types.values())} (first {sum(self.first_types.values())}); grown: "
                + ", ".join(f"{name} +{count}" for name, count in grown)
            )
            snapshot = tracemalloc.take_snapshot().filter_traces(
                (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__))
            )
            if not self.has_first:
                snapshot.dump(self.first_snapshot)
                self.has_first = True
            first = tracemalloc.Snapshot.load(self.first_snapshot)
            for stat in snapshot.compare_to(first, "lineno")[:TOP_LINES]:
                frame = stat.traceback[0]
                self._print(
                    f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks "
                    f"(now {stat.size / 1024:.1f} KiB) {frame.filename}:{frame.lineno}"
                )
            for stat in snapshot.compare_to(first, "traceback")[:3]:
                # File and line only: formatting the source would fill linecache, which grows too.
                where = " <- ".join(f"{f.filename}:{f.lineno}" for f in stat.traceback)
                self._print(f"  {stat.size_diff / 1024:+.1f} KiB {stat.count_diff:+d} blocks at {where}")
            del first, snapshot
            if trim and self.libc is not None:
                before = _status_kib()["RssAnon"]
                self.libc.malloc_trim(0)
                after = _status_kib()["RssAnon"]
                self._print(f"malloc_trim(0): RssAnon {before / 1024:.1f} -> {after / 1024:.1f} MiB")

    def final(self) -> None:
        self._stop.set()
        self._thread.join(5)
        gc.collect()
        self.dump(trim=True)
        with contextlib.suppress(OSError):
            os.unlink(self.first_snapshot)
