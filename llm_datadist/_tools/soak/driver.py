"""The soak's driver: starts the owners and pullers, relays the owners' catalogues to the pullers,
restarts the restarting owners, stops a process holding one of their index locks now and then, takes the
quiescent checkpoints, watches every process and reaps it.

Rules: the driver is one thread; `pump` serves every pipe and notices every exit, and every wait has a
deadline. A child that exits on its own, goes silent or does not stop in time is a failure; at the end
every child is gone (SIGKILL last) and every segment of the run's processes is checked and removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from ..netns import Hosts, in_netns
from .figures import (
    MOONCAKE_LANES_PER_PEER,
    Figures,
    sample,
    segment_pid,
    shm_entries,
)
from .owners import owner_main
from .pullers import PullerSummary, puller_main
from .sampler import Member, RunSampler
from .spec import IP, PULLER_CLUSTER_BASE, START_TIMEOUT_S, OwnerRef, OwnerSpec, PullerSpec

HANG_S = 30.0  # a process silent this long is hung
WARM_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
RESTART_INTERVAL_S = (3.0, 6.0)
MIN_WARMUP_S = 1.5
MIN_LIFE_S = 2.5  # a restarted owner up this long must have served at least one verified pull
INCARNATION_SAMPLE_AFTER_S = 1.0
SETTLE_S = 1.0
MAX_LOGGED_FAILURES = 10  # printed as they happen; all are listed, grouped, at the end
# Now and then a process takes a restarting owner's index lock and stops (a stalled lock holder), for a
# moment: that owner's server must go on answering, and what waits for the lock is done once it is back.
STALL_INTERVAL_S = (4.0, 8.0)
STALL_S = (0.2, 1.0)


def _stalled_lock_holder(conn: Connection, index_name: str, pid: int, incarnation: int) -> None:
    """Take the owner's index lock and stop (SIGSTOP) holding it; the driver kills it."""
    from llm_datadist._shm.index import Index

    index = Index.attach(index_name, pid=pid, incarnation=incarnation)
    index.lock(10.0)
    conn.send("locked")
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)


@dataclass
class _Child:
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


class Soak:
    def __init__(
        self,
        duration_s: float,
        seed: int,
        log_dir: str,
        out: Any = sys.stdout,
        hosts: Hosts | None = None,
        debug_memory_s: float = 0.0,
    ) -> None:
        self.debug_memory_s = debug_memory_s
        # The memory dumps slow the children down, their last one (at stop, no heartbeat meanwhile) most.
        self.stop_timeout_s = STOP_TIMEOUT_S * (4 if debug_memory_s > 0 else 1)
        self.hang_s = HANG_S * (4 if debug_memory_s > 0 else 1)
        self.log_dir = log_dir  # each child's stdout and stderr
        self.hosts = hosts  # owners on one "host", pullers on the other; None: all on this host
        self.duration_s = duration_s
        self.seed = seed
        self.out = out
        self.ctx = mp.get_context("spawn")
        self.t0 = time.monotonic()
        self.children: list[_Child] = []
        self.owners: dict[str, _Child] = {}  # the current incarnation of each owner
        self.incarnations: list[_Child] = []  # every owner incarnation, in order
        self.pullers: list[_Child] = []
        self.failures: list[str] = []
        self.aborted = False
        self.restarts: Counter[str] = Counter()
        self.events: Counter[str] = Counter()  # owner-side unlinks, stalled lock holders
        self.driver_samples: dict[str, Figures] = {}
        self.system_shm: dict[str, int] = {}
        self.leftover: list[str] = []
        self.churn_from = math.inf  # churn runs between the two checkpoints
        self.churn_until = math.inf
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

    def _spawn(self, label: str, kind: str, target: Callable[..., None], spec: object) -> _Child:
        parent, child_end = self.ctx.Pipe()
        log_path = os.path.join(self.log_dir, f"{label.replace('#', '-')}.log")
        if self.hosts is not None:
            netns = self.hosts.prompt_netns if kind == "owner" else self.hosts.decoder_netns
            target = in_netns(netns, target, self.hosts.env)
        process = self.ctx.Process(target=target, args=(child_end, spec, log_path), name=label, daemon=True)
        process.start()
        child_end.close()
        now = time.monotonic()
        child = _Child(label, kind, process, parent, now, last_seen=now, pid=process.pid or 0)
        self.children.append(child)
        return child

    def start_owner(self, ref: OwnerRef, incarnation: int) -> _Child:
        spec = OwnerSpec(ref, incarnation, self.seed, self.debug_memory_s)
        child = self._spawn(spec.label, "owner", owner_main, spec)
        child.ref, child.incarnation = ref, incarnation
        self.owners[ref.name] = child
        self.incarnations.append(child)
        return child

    def start_puller(self, spec: PullerSpec) -> _Child:
        child = self._spawn(spec.name, "puller", puller_main, spec)
        child.puller = spec
        self.pullers.append(child)
        return child

    def send(self, child: _Child, *message: object) -> None:
        if child.conn is None:
            return
        try:
            child.conn.send(message)
        except (OSError, ValueError) as exc:
            if not child.expected_exit:
                self.failure(f"{child.label}: cannot send {message[0]!r}: {exc}")

    def live(self) -> list[_Child]:
        return [c for c in self.children if not c.exited]

    def _on_message(self, child: _Child, message: tuple[Any, ...]) -> None:
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

    def _drain(self, child: _Child) -> None:
        conn = child.conn
        if conn is None:
            return
        try:
            while conn.poll(0):
                self._on_message(child, conn.recv())
        except (EOFError, OSError):
            conn.close()
            child.conn = None

    def _on_exit(self, child: _Child) -> None:
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
            by_object: dict[Any, tuple[_Child, bool]] = {}
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
                self._sample_child(child, "start")

    def _sample_child(self, child: _Child, when: str, entries: list[str] | None = None) -> None:
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
        self, what: str, children: list[_Child], flag: Callable[[_Child], bool], timeout_s: float
    ) -> bool:
        if self.pump(timeout_s, lambda: self.aborted or all(flag(c) or c.exited for c in children)):
            return not self.aborted
        missing = [c.label for c in children if not flag(c)]
        self.failure(
            f"timed out after {timeout_s:.0f} s waiting for {what}: {', '.join(missing)}", abort=True
        )
        return False

    def restart(self, name: str, how: str) -> None:
        old = self.owners[name]
        assert old.ref is not None
        if old.up_at is not None and time.monotonic() - old.up_at >= INCARNATION_SAMPLE_AFTER_S:
            self._sample_child(old, "end")
        old.expected_exit = True
        old.down_at = time.monotonic()
        if how == "SIGKILL":
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGKILL)
        else:
            self.send(old, "stop")
        if not self.pump(STOP_TIMEOUT_S, lambda: old.exited):
            self.failure(f"{old.label} did not exit within {STOP_TIMEOUT_S:.0f} s of {how}", abort=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGKILL)
            return
        if how != "SIGKILL" and not old.stopped:
            self.failure(f"{old.label} exited on stop without reporting it stopped")
        self.restarts[how] += 1
        new = self.start_owner(old.ref, old.incarnation + 1)
        if self.wait_for(f"{new.label} to come up", [new], lambda c: c.up_at is not None, START_TIMEOUT_S):
            self.log(f"{old.label} {'killed (SIGKILL)' if how == 'SIGKILL' else 'finalized'}; {new.label} up")

    def stall(self, name: str, seconds: float) -> None:
        """A process takes owner `name`'s index lock and stops for `seconds`, then dies (the kernel drops
        the lock). A stalled holder that cannot start is a failure; one of an owner that is restarting
        meanwhile is nothing (the index went with its owner)."""
        owner = self.owners[name]
        if owner.index is None or owner.up_at is None or owner.exited:
            return
        parent, child_end = self.ctx.Pipe()
        process = self.ctx.Process(
            target=_stalled_lock_holder,
            args=(child_end, owner.index[0], owner.pid, owner.index[1]),
            daemon=True,
        )
        process.start()
        child_end.close()
        try:
            if parent.poll(START_TIMEOUT_S):
                parent.recv()
                self.events["stalled lock holder"] += 1
                self.pump(seconds)
            elif not owner.exited:
                self.failure(f"a stalled lock holder of {owner.label} did not take the lock", abort=True)
        except EOFError:
            pass  # it could not attach: the owner just restarted
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid or 0, signal.SIGKILL)
            process.join(10)
            parent.close()

    def checkpoint(self, when: str) -> None:
        owners = list(self.owners.values())
        for child in owners:
            child.quiet = False
            self.send(child, "quiesce")
        if not self.wait_for(f"owners to quiesce ({when})", owners, lambda c: c.quiet, START_TIMEOUT_S):
            return
        for child in self.pullers:
            child.quiet = False
            self.send(child, "quiesce")
        if not self.wait_for(
            f"pullers to quiesce ({when})", self.pullers, lambda c: c.quiet, START_TIMEOUT_S
        ):
            return
        # Leases are released one way and segments unlinked behind them: let the figures settle.
        self.pump(SETTLE_S)
        previous: dict[int, Figures] = {}
        deadline = time.monotonic() + 5 * SETTLE_S
        members = [*owners, *self.pullers]
        while True:
            entries = shm_entries()
            engine = self.hosts is not None
            current = {c.pid: sample(c.pid, entries, engine_sockets=engine) for c in members if not c.exited}
            current[os.getpid()] = sample(os.getpid(), entries, engine_sockets=engine)
            stable = previous and all(
                _without_rss(current[pid]) == _without_rss(previous.get(pid, current[pid])) for pid in current
            )
            if stable or time.monotonic() > deadline:
                break
            previous = current
            self.pump(SETTLE_S / 2)
        for child in members:
            if child.pid in current:
                child.samples[when] = current[child.pid]
        self.driver_samples[when] = current[os.getpid()]
        for child in [*owners, *self.pullers]:
            child.quiet = False
            self.send(child, "resume")
        self.log(f"checkpoint {when!r}: figures sampled for {len(current)} processes")

    def run(self, ports: list[int]) -> None:
        owner_ip, puller_ip = (self.hosts.prompt_ip, self.hosts.decoder_ip) if self.hosts else (IP, IP)
        refs = [
            OwnerRef("v1-steady", "v1", 1, ports[0], False, owner_ip),
            OwnerRef("v1-restart", "v1", 2, ports[1], True, owner_ip),
            OwnerRef("v2-steady", "v2", 3, ports[2], False, owner_ip),
            OwnerRef("v2-restart", "v2", 4, ports[3], True, owner_ip),
        ]
        self.system_shm["start"] = len(shm_entries())
        for ref in refs:
            self.start_owner(ref, 1)
        owners = list(self.owners.values())
        if not self.wait_for("owners to come up", owners, lambda c: c.up_at is not None, START_TIMEOUT_S):
            return
        self.log(
            f"owners up: {', '.join(f'{c.label} (pid {c.pid}, port {c.ref.port})' for c in owners if c.ref)}"
        )
        for index, mode in enumerate(("v1", "v2", "v2-leased")):
            name = f"puller-{index + 1}"
            sources = tuple(r for r in refs if mode.startswith(r.mode))
            cluster_id = PULLER_CLUSTER_BASE + index
            spec = PullerSpec(name, mode, cluster_id, self.seed, sources, puller_ip, self.debug_memory_s)
            self.start_puller(spec)
        if not self.wait_for("pullers to link", self.pullers, lambda c: c.up_at is not None, START_TIMEOUT_S):
            return
        warm_from = time.monotonic()
        if not self.wait_for(
            "a verified pull of every kind (warm-up)", self.pullers, lambda c: c.warm, WARM_TIMEOUT_S
        ):
            return
        self.pump(max(0.0, MIN_WARMUP_S - (time.monotonic() - warm_from)))
        self.checkpoint("start")
        if self.aborted:
            return
        self.churn_from = time.monotonic()
        self.sampler.start(self.churn_from)
        rng = random.Random(self.seed)
        now = time.monotonic()
        end = now + self.duration_s
        restarting = [r.name for r in refs if r.restarting]
        next_restart = {name: now + rng.uniform(*RESTART_INTERVAL_S) for name in restarting}
        next_how = {name: rng.choice(("SIGKILL", "finalize")) for name in restarting}
        next_stall = now + rng.uniform(*STALL_INTERVAL_S)
        self.log(
            f"churn for {self.duration_s:.0f} s (owners restart every {RESTART_INTERVAL_S[0]:.0f}-"
            f"{RESTART_INTERVAL_S[1]:.0f} s)"
        )
        while not self.aborted:
            now = time.monotonic()
            if now >= end:
                break
            if next_stall <= now:
                self.stall(rng.choice(restarting), rng.uniform(*STALL_S))
                next_stall = time.monotonic() + rng.uniform(*STALL_INTERVAL_S)
                continue
            due = [name for name in restarting if next_restart[name] <= now]
            if not due:
                self.pump(min(end, next_stall, *next_restart.values()) - now)
                continue
            for name in due:
                how = next_how[name]
                next_how[name] = "finalize" if how == "SIGKILL" else "SIGKILL"
                self.restart(name, how)
                next_restart[name] = time.monotonic() + rng.uniform(*RESTART_INTERVAL_S)
        self.churn_until = time.monotonic()
        self.sampler.stop()
        if not self.aborted:
            self.checkpoint("end")

    def teardown(self) -> None:
        """Stop the pullers, then the owners (clean `finalize()`); SIGKILL what does not go in time."""
        for group in (self.pullers, list(self.owners.values())):
            members = [c for c in group if not c.exited]
            for child in members:
                child.expected_exit = True
                child.down_at = child.down_at or time.monotonic()
                self.send(child, "stop")
            self.pump(self.stop_timeout_s, lambda members=members: all(c.exited for c in members))  # type: ignore[misc]
            for child in members:
                if not child.exited:
                    self.failure(
                        f"{child.label} (pid {child.pid}) did not stop within {self.stop_timeout_s:.0f} s"
                    )
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGKILL)
            self.pump(10, lambda members=members: all(c.exited for c in members))  # type: ignore[misc]
        for child in self.children:
            if child.kind == "puller" and child.summary is None and not self.aborted:
                self.failure(f"{child.label} sent no summary")

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

    def check_segments(self) -> None:
        """Every segment a process of this run created must be gone: owners unlink at `finalize()`, and a
        killed owner's are reaped by its successor or by a survivor. Leftovers fail the run, then go."""
        pids = {c.pid for c in self.children}
        deadline = time.monotonic() + 5
        while True:
            left = sorted(name for name in shm_entries() if segment_pid(name) in pids)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if left:
            self.failure(f"{len(left)} segment(s) of this run's processes left in /dev/shm: {left[:5]}")
            for name in left:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", name))
        self.leftover = left
        self.system_shm["end"] = len(shm_entries())

    # -- report

    def checks(self) -> None:
        """Progress: every restarted incarnation that was up long enough served a verified pull."""
        served: Counter[tuple[str, int]] = Counter()
        for child in self.pullers:
            if child.summary is not None:
                served.update(child.summary.by_incarnation)
        for child in self.incarnations:
            if child.ref is None or child.up_at is None:
                continue
            # Only churn time counts: owners publish nothing while a checkpoint holds them quiet.
            life = min(child.down_at or math.inf, self.churn_until) - max(child.up_at, self.churn_from)
            if life >= MIN_LIFE_S and served[(child.ref.name, child.incarnation)] == 0:
                self.failure(f"{child.label} was up {life:.1f} s and no puller verified a pull from it")
        for child in self.pullers:
            if child.summary is not None and child.summary.verified == 0:
                self.failure(f"{child.label} verified no pull at all")
        if self.hosts is None:
            return
        # Mooncake keeps its connections to an engine that is gone: bounded by its lanes a peer for each
        # owner incarnation a puller read from that ended during the churn; anything more is a leak.
        for child in self.pullers:
            end = child.samples.get("end")
            if end is None or child.puller is None:
                continue
            mode = child.puller.mode
            ended = sum(
                1
                for c in self.incarnations
                if c.ref is not None
                and mode.startswith(c.ref.mode)
                and c.down_at is not None
                and c.down_at <= self.churn_until
            )
            if end.stale_engine_sockets > MOONCAKE_LANES_PER_PEER * ended:
                self.failure(
                    f"{child.label} holds {end.stale_engine_sockets} connections to engines that are "
                    f"gone, more than {MOONCAKE_LANES_PER_PEER} for each of the {ended} owner incarnations "
                    "that ended"
                )


def _without_rss(figures: Figures) -> tuple[object, ...]:
    return (
        figures.fds,
        figures.threads,
        figures.shm_live_nbytes,
        figures.shm_deleted_nbytes,
        figures.segments,
    )
