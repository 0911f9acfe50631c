"""Sampling through the churn: every long-lived process's figures every few seconds, and the progress line.

Rules: the driver calls `tick` from its loop; a sample reads /proc only (the processes never pause), one
/dev/shm listing serves every process of a tick, and a process that is gone is skipped (its exit is the
driver's to report). The series start when the churn starts and stop when it ends; the quiescent
checkpoints are the driver's and are kept apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from .figures import HOST_RULES, RULES, Rule, Series, sample, shm_entries

SAMPLE_EVERY_S = 5.0  # 12 samples a minute: a 30-minute run pins a noisy slope to a few MiB an hour
PROGRESS_EVERY_S = 5.0
# The baseline of "worst" is the median of a process's first samples, its "now" the median of its latest.
GROWTH_SPAN = 6
# Not candidates for "worst": under load RSS and the /dev/shm bytes mapped follow the pools (a v1 process's
# swing by hundreds of MiB as segments come and go; a restarted owner's retired table stays mapped until the
# puller relinks); the anonymous part of RSS is where a leak shows, and the checkpoints judge the rest.
_FOLLOW_THE_POOLS = frozenset({"rss_nbytes", "shm_live_nbytes", "shm_deleted_nbytes"})


@dataclass(frozen=True)
class Member:
    """A process to sample: the label it has in the table and its pid."""

    label: str
    pid: int


@dataclass(frozen=True)
class Growth:
    label: str
    rule: Rule
    baseline: float
    now: float

    @property
    def relative(self) -> float:
        if self.baseline > 0:
            return (self.now - self.baseline) / self.baseline
        return math.inf if self.now > self.baseline else 0.0

    def describe(self) -> str:
        def show(x: float) -> str:
            return f"{x / self.rule.unit:.1f}" if self.rule.unit > 1 else f"{x:.0f}"

        unit = self.rule.title.rsplit(" ", 1)
        name, suffix = (unit[0], f" {unit[1]}") if unit[-1] == "MiB" else (self.rule.title, "")
        ratio = f"+{self.relative:.0%}" if math.isfinite(self.relative) else "from 0"
        return f"{self.label} {name} {show(self.baseline)} -> {show(self.now)}{suffix} ({ratio})"


class RunSampler:
    def __init__(self, *, engine_sockets: bool) -> None:
        self.engine_sockets = engine_sockets
        rules = (*RULES, *HOST_RULES) if engine_sockets else RULES
        self.rules = tuple(r for r in rules if r.attribute not in _FOLLOW_THE_POOLS)
        self.series: dict[str, Series] = {}
        self.churn_from = math.inf
        self.next_sample = math.inf
        self.next_progress = math.inf

    def start(self, now: float) -> None:
        """The churn begins: the first sample is due at once, the first progress line a period later."""
        self.churn_from = now
        self.next_sample = now
        self.next_progress = now + PROGRESS_EVERY_S

    def stop(self) -> None:
        self.next_sample = self.next_progress = math.inf

    def tick(self, now: float, members: Sequence[Member]) -> bool:
        """Samples `members` when a sample is due; True when a progress line is due (the caller prints
        `progress`)."""
        if now >= self.next_sample:
            self.next_sample = now + SAMPLE_EVERY_S
            entries = shm_entries()
            for member in members:
                try:
                    figures = sample(member.pid, entries, engine_sockets=self.engine_sockets)
                except (psutil.Error, OSError):
                    continue
                self.series.setdefault(member.label, Series()).add(now - self.churn_from, figures)
        if now >= self.next_progress:
            self.next_progress = now + PROGRESS_EVERY_S
            return True
        return False

    def worst(self) -> Growth | None:
        """The process and figure that grew most over its baseline, relative to it (None: none grew, or
        not `GROWTH_SPAN` samples yet)."""
        grown = [
            Growth(label, rule, *span)
            for label, series in self.series.items()
            for rule in self.rules
            if (span := series.growth(rule.attribute, GROWTH_SPAN)) is not None and span[1] > span[0]
        ]
        return max(grown, key=lambda g: (g.relative, g.now - g.baseline), default=None)

    def progress(self, now: float, pulls: int, verified_nbytes: int, restarts: int, failures: int) -> str:
        churned = max(0.0, now - self.churn_from)
        minutes, seconds = divmod(int(churned), 60)
        worst = self.worst()
        return (
            f"{minutes}:{seconds:02d} churned: {pulls:,} pulls ({verified_nbytes / (1 << 30):.1f} GiB "
            f"verified), restarts {restarts}, failures {failures}; worst: "
            + (worst.describe() if worst is not None else "nothing grew")
        )
