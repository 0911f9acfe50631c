"""The soak's driver: the run itself. Starts the owners and pullers, restarts the restarting owners, stops
a process holding one of their index locks now and then, takes the quiescent checkpoints, stops everyone,
then checks what the run left and whether every owner incarnation served.

Rules: the processes and the loop that serves them are the crew's (`crew.Crew`); the driver only decides
what happens when, and every wait is the crew's `pump` with a deadline. At the end every child is gone
(SIGKILL last) and every segment of the run's processes is checked and removed.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

from llm_datadist._shm.index import Index

from ..netns import Hosts
from .crew import INCARNATION_SAMPLE_AFTER_S, Crew
from .figures import Figures, sample, segment_pid, shm_entries
from .spec import IP, PULLER_CLUSTER_BASE, START_TIMEOUT_S, OwnerRef, PullerSpec

WARM_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
RESTART_INTERVAL_S = (3.0, 6.0)
MIN_WARMUP_S = 1.5
MIN_LIFE_S = 2.5  # a restarted owner up this long must have served at least one verified pull
SETTLE_S = 1.0
# Now and then a process takes a restarting owner's index lock and stops (a stalled lock holder), for a
# moment: that owner's server must go on answering, and what waits for the lock is done once it is back.
STALL_INTERVAL_S = (4.0, 8.0)
STALL_S = (0.2, 1.0)


def _stalled_lock_holder(conn: Connection, index_name: str, pid: int, incarnation: int) -> None:
    """Take the owner's index lock and stop (SIGSTOP) holding it; the driver kills it."""
    index = Index.attach(index_name, pid=pid, incarnation=incarnation)
    index.lock(10.0)
    conn.send("locked")
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)


class Soak(Crew):
    """One run of `duration_s` of churn with `seed`: `run(ports)`, `teardown()`, then (always) `kill_all()`
    and `check_segments()`, then `checks()`; the report reads the figures gathered here and in the crew."""

    def __init__(
        self,
        duration_s: float,
        seed: int,
        log_dir: str,
        out: Any = sys.stdout,
        hosts: Hosts | None = None,
        debug_memory_s: float = 0.0,
    ) -> None:
        super().__init__(seed, log_dir, out, hosts, debug_memory_s)
        # The memory dumps slow the children down, their last one (at stop, no heartbeat meanwhile) most.
        self.stop_timeout_s = STOP_TIMEOUT_S * (4 if debug_memory_s > 0 else 1)
        self.duration_s = duration_s
        self.driver_samples: dict[str, Figures] = {}
        self.system_shm: dict[str, int] = {}
        self.leftover: list[str] = []
        self.churn_from = math.inf  # churn runs between the two checkpoints
        self.churn_until = math.inf

    # -- phases

    def restart(self, name: str, how: str) -> None:
        old = self.owners[name]
        assert old.ref is not None
        if old.up_at is not None and time.monotonic() - old.up_at >= INCARNATION_SAMPLE_AFTER_S:
            self.sample_child(old, "end")
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


def _without_rss(figures: Figures) -> tuple[object, ...]:
    return (
        figures.fds,
        figures.threads,
        figures.shm_live_nbytes,
        figures.shm_deleted_nbytes,
        figures.segments,
    )
