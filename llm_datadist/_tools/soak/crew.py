"""The soak's crew: every child process of a run (owners, pullers) with its pipe, and the one loop that
serves them. `pump` drains every pipe, relays the owners' catalogues to the pullers of their kind, notices
every exit and every silence, and samples the long-lived processes' figures as the run goes.

Rules: one thread; every wait is `pump` with a deadline. A child that exits unasked, goes silent for
`hang_s` or reports a failure is a failure of the run; `kill_all` leaves no child alive. What a run does
with its crew (start, restart, stall, checkpoint, stop) is the driver's (`driver.Soak`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from ..netns import Hosts, in_netns
from .figures import Figures, sample, shm_entries
from .owners import owner_main
from .pullers import PullerSummary, puller_main
from .sampler import Member, RunSampler
from .spec import OwnerRef, OwnerSpec, PullerSpec

HANG_S = 30.0  # a process silent this long is hung
INCARNATION_SAMPLE_AFTER_S = 1.0
MAX_LOGGED_FAILURES = 10  # printed as they happen; all are listed, grouped, at the end


@dataclass
class Child:
    """One process of the run, as the pump has seen it: what it is, what it last reported, how it ended."""

    label: str
    kind: str  # "owner" or "puller"
    process: BaseProcess | None  # None once it exited and was reaped (a run has hundreds of incarnations)
    conn: Connection | None
    started_at: float
    ref: OwnerRef | None = None
    puller: PullerSpec | None = None
    incarnation: int = 0
    pid: int = 0
    up_at: float | None = None
    down_at: float | None = None
    warm: bool = False
    quiet: bool = False
    stopped: bool = False
    exited: bool = False
    expected_exit: bool = False
    last_seen: float = 0.0
    summary: PullerSummary | None = None
    samples: dict[str, Figures] = field(default_factory=dict)
    index: tuple[str, int] | None = None  # an owner's index name and incarnation
    pulls: int = 0  # a puller's verified pulls and bytes so far, from its heartbeats
    pulled_nbytes: int = 0


class Crew:
    """The run's child processes, by role: `owners` (the current incarnation of each), `incarnations` (every
    owner incarnation, in order), `pullers`; `failures` so far, `aborted` once one ends the run."""

    def __init__(self, seed: int, log_dir: str, out: Any, hosts: Hosts | None, debug_memory_s: float) -> None:
        self.seed = seed
        self.debug_memory_s = debug_memory_s
        # The memory dumps slow the children down: a silence is a hang only after longer.
        self.hang_s = HANG_S * (4 if debug_memory_s > 0 else 1)
        self.log_dir = log_dir  # each child's stdout and stderr
        self.hosts = hosts  # owners on one "host", pullers on the other; None: all on this host
        self.out = out
        self.ctx = mp.get_context("spawn")
        self.t0 = time.monotonic()
        self.children: list[Child] = []
        self.owners: dict[str, Child] = {}  # the current incarnation of each owner
        self.incarnations: list[Child] = []  # every owner incarnation, in order
        self.pullers: list[Child] = []
        self.failures: list[str] = []
        self.aborted = False
        self.restarts: Counter[str] = Counter()  # by how: "SIGKILL" or "finalize"
        self.events: Counter[str] = Counter()  # owner-side unlinks, stalled lock holders
        self.sampler = RunSampler(engine_sockets=hosts is not None)

    # -- output

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f} s] {text}", file=self.out, flush=True)

    def failure(self, text: str, *, abort: bool = False) -> None:
        self.failures.append(text)
        if len(self.failures) <= MAX_LOGGED_FAILURES:
            self.log(f"FAILURE: {text.splitlines()[0] if text else text}")
        if len(self.failures) == MAX_LOGGED_FAILURES:
            self.log("(further failures are listed at the end)")
        if abort:
            self.aborted = True

    # -- processes

    def _spawn(self, label: str, kind: str, target: Callable[..., None], spec: object) -> Child:
        parent, child_end = self.ctx.Pipe()
        log_path = os.path.join(self.log_dir, f"{label.replace('#', '-')}.log")
        if self.hosts is not None:
            netns = self.hosts.prompt_netns if kind == "owner" else self.hosts.decoder_netns
            target = in_netns(netns, target, self.hosts.env)
        process = self.ctx.Process(target=target, args=(child_end, spec, log_path), name=label, daemon=True)
        process.start()
        child_end.close()
        now = time.monotonic()
        child = Child(label, kind, process, parent, now, last_seen=now, pid=process.pid or 0)
        self.children.append(child)
        return child

    def start_owner(self, ref: OwnerRef, incarnation: int) -> Child:
        spec = OwnerSpec(ref, incarnation, self.seed, self.debug_memory_s)
        child = self._spawn(spec.label, "owner", owner_main, spec)
        child.ref, child.incarnation = ref, incarnation
        self.owners[ref.name] = child
        self.incarnations.append(child)
        return child

    def start_puller(self, spec: PullerSpec) -> Child:
        child = self._spawn(spec.name, "puller", puller_main, spec)
        child.puller = spec
        self.pullers.append(child)
        return child

    def send(self, child: Child, *message: object) -> None:
        if child.conn is None:
            return
        try:
            child.conn.send(message)
        except (OSError, ValueError) as exc:
            if not child.expected_exit:
                self.failure(f"{child.label}: cannot send {message[0]!r}: {exc}")

    def live(self) -> list[Child]:
        return [c for c in self.children if not c.exited]

    def _on_message(self, child: Child, message: tuple[Any, ...]) -> None:
        child.last_seen = time.monotonic()
        command = message[0]
        if command in ("pub", "ret"):
            mode = child.ref.mode if child.ref is not None else ""
            for puller in self.pullers:
                # Not to a puller told to stop: it reads no more, and a full pipe would block the driver.
                if (
                    puller.puller is not None
                    and puller.puller.mode.startswith(mode)
                    and not puller.exited
                    and not puller.expected_exit
                ):
                    self.send(puller, *message)
        elif command == "beat" and len(message) == 3:
            child.pulls, child.pulled_nbytes = int(message[1]), int(message[2])
        elif command in ("up", "ready"):
            child.up_at = time.monotonic()
            if command == "up" and len(message) == 4:
                child.index = (str(message[2]), int(message[3]))
        elif command == "event":
            self.events[str(message[1])] += 1
        elif command == "warm":
            child.warm = True
        elif command == "quiet":
            child.quiet = True
        elif command == "fail":
            self.failure(str(message[1]))
        elif command == "stopped":
            child.stopped = True
        elif command == "done":
            child.summary = message[1]
            child.stopped = True

    def _drain(self, child: Child) -> None:
        conn = child.conn
        if conn is None:
            return
        try:
            while conn.poll(0):
                self._on_message(child, conn.recv())
        except (EOFError, OSError):
            conn.close()
            child.conn = None

    def _on_exit(self, child: Child) -> None:
        self._drain(child)
        process = child.process
        assert process is not None  # only live children exit
        process.join(1)
        child.exited = True
        child.down_at = child.down_at or time.monotonic()
        code = process.exitcode
        if not child.expected_exit:
            self.failure(f"{child.label} (pid {child.pid}) exited unexpectedly, exit code {code}", abort=True)
        elif code not in (0, -signal.SIGKILL):
            self.failure(f"{child.label} (pid {child.pid}) exited with code {code}")
        if child.conn is not None:
            child.conn.close()
            child.conn = None
        process.close()
        child.process = None

    def pump(self, seconds: float, until: Callable[[], bool] | None = None) -> bool:
        """Serve every pipe and watch every process for `seconds` or until `until()` holds."""
        deadline = time.monotonic() + seconds
        while True:
            if until is not None and until():
                return True
            now = time.monotonic()
            if now >= deadline:
                return until is None
            by_object: dict[Any, tuple[Child, bool]] = {}
            for child in self.live():
                if child.conn is not None:
                    by_object[child.conn] = (child, False)
                assert child.process is not None  # live
                by_object[child.process.sentinel] = (child, True)
            if not by_object:
                time.sleep(min(0.1, deadline - now))
                continue
            for obj in wait(list(by_object), timeout=min(0.1, deadline - now)):
                child, is_sentinel = by_object[obj]
                if child.exited:
                    continue
                if is_sentinel:
                    self._on_exit(child)
                else:
                    self._drain(child)
            self._watch()
            self._tick()

    def _tick(self) -> None:
        """Through the churn: every long-lived process's figures every few seconds, and the progress line."""
        members = [
            Member(c.label, c.pid)
            for c in [*self.owners.values(), *self.pullers]
            if not c.exited and not (c.ref is not None and c.ref.restarting)
        ]
        now = time.monotonic()
        if self.sampler.tick(now, [Member("driver", os.getpid()), *members]):
            self.log(
                self.sampler.progress(
                    now,
                    sum(c.pulls for c in self.pullers),
                    sum(c.pulled_nbytes for c in self.pullers),
                    sum(self.restarts.values()),
                    len(self.failures),
                )
            )

    def _watch(self) -> None:
        now = time.monotonic()
        for child in self.live():
            if now - child.last_seen > self.hang_s:
                silent = f"silent for {self.hang_s:.0f} s: hung"
                self.failure(f"{child.label} (pid {child.pid}) {silent}", abort=True)
                child.expected_exit = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
                child.last_seen = now
            if (
                child.kind == "owner"
                and child.up_at is not None
                and "start" not in child.samples
                and child.ref is not None
                and child.ref.restarting
                and now - child.up_at >= INCARNATION_SAMPLE_AFTER_S
            ):
                self.sample_child(child, "start")

    def sample_child(self, child: Child, when: str, entries: list[str] | None = None) -> None:
        try:
            figures = sample(
                child.pid,
                shm_entries() if entries is None else entries,
                engine_sockets=self.hosts is not None,
            )
            # Shown for information, in hundreds of rows: without the descriptors' names, which no rule reads.
            child.samples[when] = dataclasses.replace(figures, fd_kinds=())
        except (psutil.Error, OSError) as exc:
            if not child.expected_exit:
                self.failure(f"{child.label}: cannot sample its figures: {exc}")

    # -- phases

    def wait_for(
        self, what: str, children: list[Child], flag: Callable[[Child], bool], timeout_s: float
    ) -> bool:
        if self.pump(timeout_s, lambda: self.aborted or all(flag(c) or c.exited for c in children)):
            return not self.aborted
        missing = [c.label for c in children if not flag(c)]
        self.failure(
            f"timed out after {timeout_s:.0f} s waiting for {what}: {', '.join(missing)}", abort=True
        )
        return False

    def kill_all(self) -> None:
        for child in self.children:
            if child.exited:
                continue
            child.expected_exit = True
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(child.pid, signal.SIGKILL)
            if child.process is not None:
                child.process.join(10)
            if child.conn is not None:
                child.conn.close()
                child.conn = None
            child.exited = True
