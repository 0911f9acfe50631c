"""The soak's report: the table of every long-lived process's figures, the restarted incarnations, the
counts of pulls, restarts and expected errors.

Rules: it only prints what the driver gathered, and returns what is not flat; the verdict is the driver's.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from typing import Any

from .driver import Soak
from .figures import (
    HOST_RULES,
    MEMORY_TREND,
    RSS_TOLERANCE_NBYTES,
    RULES,
    STALE_ENGINE_SOCKETS,
    Figures,
    Rule,
    Series,
    is_flat,
)
from .sampler import SAMPLE_EVERY_S
from .trend import Trend

COLUMN = 14  # characters a figure's column takes


def report(run: Soak) -> list[str]:
    """Prints the tables; returns the figures that are not flat."""
    out = run.out
    not_flat: list[str] = []
    print("", file=out)
    # A run that stopped early never ended its churn: its samples run to now.
    churn_end = run.churn_until if math.isfinite(run.churn_until) else time.monotonic()
    churn_s = max(0.0, churn_end - run.churn_from) if math.isfinite(run.churn_from) else 0.0
    print("\n".join(_legend(churn_s)), file=out)
    header = f"{'process':<28}{'pid':>8}  {'sample':<8}" + "".join(f"{r.title:>{COLUMN}}" for r in RULES)
    print(header, file=out)
    print("-" * len(header), file=out)
    rows: list[tuple[str, int, dict[str, Figures]]] = [("driver", os.getpid(), run.driver_samples)]
    long_lived = [c for c in run.incarnations if c.ref is not None and not c.ref.restarting]
    for child in [*long_lived, *run.pullers]:
        mode = child.ref.mode if child.ref is not None else (child.puller.mode if child.puller else "")
        role = "owner" if child.kind == "owner" else "puller"
        rows.append((f"{child.label} ({mode} {role})", child.pid, child.samples))
    for label, pid, samples in rows:
        _print_rows(out, label, pid, samples)
        series = run.sampler.series.get(label.split(" (")[0], Series())
        trends = [series.trend(rule, churn_s) for rule in RULES]
        print(
            f"{'':<38}{'trend/h':<8}"
            + "".join(f" {_slope(t, r):>{COLUMN - 1}}" for t, r in zip(trends, RULES, strict=True)),
            file=out,
        )
        start, end = samples.get("start"), samples.get("end")
        if start is None or end is None:
            not_flat.append(f"{label}: not sampled at both checkpoints (the run stopped early)")
            continue
        verdicts = []
        for rule, trend in zip(RULES, trends, strict=True):
            if is_flat(rule, start, end) and not trend.growing:
                verdicts.append("flat")
            elif is_flat(rule, start, end):
                verdicts.append("GROWING")
                not_flat.append(f"{label}: {rule.title} {_growing(trend, rule)}")
            else:
                verdicts.append("NOT FLAT")
                a, b = getattr(start, rule.attribute), getattr(end, rule.attribute)
                detail = ""
                if rule.attribute == "own_fds":
                    more = Counter(end.fd_kinds) - Counter(start.fd_kinds)
                    fewer = Counter(start.fd_kinds) - Counter(end.fd_kinds)
                    detail = f" (new: {dict(more)}, gone: {dict(fewer)})"
                not_flat.append(
                    f"{label}: {rule.title} {_format(a, rule.unit)} -> {_format(b, rule.unit)}{detail}"
                )
        print(f"{'':<38}{'verdict':<8}" + "".join(f"{v:>{COLUMN}}" for v in verdicts), file=out)
    if run.hosts is not None:
        print("", file=out)
        print(
            "Across hosts, not in fds above: the transfer engines' TCP connections (no more at the end than "
            "at the start), and of those the ones to engines of owners that are gone (CLOSE_WAIT; none at "
            "either checkpoint), start -> end:",
            file=out,
        )
        for child in [*long_lived, *run.pullers]:
            start, end = child.samples.get("start"), child.samples.get("end")
            if start is None or end is None:
                continue
            series = run.sampler.series.get(child.label, Series())
            trend = series.trend(STALE_ENGINE_SOCKETS, churn_s)
            rate = "" if trend.slope is None else f" trend {_slope(trend, STALE_ENGINE_SOCKETS)} an hour"
            flat = all(is_flat(rule, start, end) for rule in HOST_RULES)
            print(
                f"  {child.label:<26} {start.engine_sockets:>4} -> {end.engine_sockets:<4} of which "
                f"to engines gone {start.stale_engine_sockets:>4} -> {end.stale_engine_sockets:<4}"
                + rate
                + ("" if flat else "  NOT FLAT"),
                file=out,
            )
            for rule in HOST_RULES:
                if not is_flat(rule, start, end):
                    a, b = getattr(start, rule.attribute), getattr(end, rule.attribute)
                    want = "0 at both" if rule.zero else f"at most {a}"
                    not_flat.append(f"{child.label}: {rule.title} {a} -> {b} (want {want})")
    restarted = [c for c in run.incarnations if c.ref is not None and c.ref.restarting]
    if restarted:
        print("", file=out)
        print(
            "Restarted owners, one row per incarnation (start 1 s after it came up, end just before "
            "its stop; not quiescent, so for information):",
            file=out,
        )
        print(header, file=out)
        for child in restarted:
            mode = child.ref.mode if child.ref else ""
            _print_rows(out, f"{child.label} ({mode} owner)", child.pid, child.samples)
    print("", file=out)
    print(
        f"/dev/shm entries on this host (all users and sessions, for information): "
        f"{run.system_shm.get('start', '-')} at start, {run.system_shm.get('end', '-')} at end; "
        f"left by this run: {len(run.leftover)}",
        file=out,
    )
    summaries = [c.summary for c in run.pullers if c.summary is not None]
    verified = sum(s.verified for s in summaries)
    nbytes = sum(s.verified_nbytes for s in summaries)
    stale = sum(s.stale for s in summaries)
    expected: Counter[str] = Counter()
    for s in summaries:
        expected.update(s.expected)
    print(
        f"pulls verified: {verified} ({nbytes / (1 << 30):.2f} GiB, every byte checked); "
        f"restarts: {sum(run.restarts.values())} ({run.restarts['SIGKILL']} SIGKILL, "
        f"{run.restarts['finalize']} finalize); owner incarnations: {len(run.incarnations)}; "
        f"owner-side unlinks: {run.events['owner-side unlink']}; "
        f"stalled lock holders: {run.events['stalled lock holder']}",
        file=out,
    )
    for child in run.pullers:
        summary = child.summary
        if summary is not None:
            print(
                f"  {child.label} ({child.puller.mode if child.puller else ''}): "
                f"{summary.verified} pulls, "
                f"{summary.verified_nbytes / (1 << 20):.1f} MiB verified, {summary.failures} failure(s)",
                file=out,
            )
    print(
        f"stale catalogue entries (a restarted v2 owner reused a cache id; bytes intact): {stale}",
        file=out,
    )
    print("expected errors by call and code:" + ("" if expected else " none"), file=out)
    for name, count in sorted(expected.items()):
        print(f"  {name:<45}{count:>8}", file=out)
    return not_flat


def _print_rows(out: Any, label: str, pid: int, samples: dict[str, Figures]) -> None:
    for when in ("start", "end"):
        figures = samples.get(when)
        cells = "".join(
            f"{_format(getattr(figures, r.attribute), r.unit):>{COLUMN}}" if figures else f"{'-':>{COLUMN}}"
            for r in RULES
        )
        first = when == "start"
        print(f"{label if first else '':<28}{pid if first else '':>8}  {when:<8}{cells}", file=out)


def _format(value: int, unit: int) -> str:
    return f"{value / unit:.1f}" if unit > 1 else str(value)


def _legend(churn_s: float) -> tuple[str, ...]:
    rule = MEMORY_TREND
    skip_s = max(rule.min_skip_s, rule.skip_fraction * churn_s)
    window_s = churn_s - skip_s
    judged = (
        f"this run's {window_s / 60:.1f} min are judged"
        if window_s >= rule.min_window_s
        else f"this run has {max(0.0, window_s) / 60:.1f} min of them: not judged, the checkpoints decide"
    )
    return (
        "Resource figures at two quiescent checkpoints (after warm-up, at the end). Flat means: RSS and its "
        f"anonymous part within +{RSS_TOLERANCE_NBYTES >> 20} MiB;",
        "fds and threads exactly equal; /dev/shm bytes mapped (live) and own segments back to at most the "
        "start;",
        "/dev/shm bytes mapped of deleted (retired) segments 0 at both.",
        f"trend/h: the Theil-Sen slope an hour of the samples taken every {SAMPLE_EVERY_S:.0f} s through the "
        f"churn, after its first third (at least {rule.min_skip_s / 60:.0f} min), +- half its 95% interval;",
        f"anon MiB is GROWING when the whole interval lies above +{rule.max_per_h / (1 << 20):.0f} MiB/h, "
        f"once those samples span {rule.min_window_s / 60:.0f} min ({judged}).",
    )


def _slope(trend: Trend, rule: Rule) -> str:
    slope = trend.slope
    if slope is None:
        return "-"
    per_h, half = slope.per_h / rule.unit, (slope.high_per_s - slope.low_per_s) * 1800.0 / rule.unit

    def short(x: float, sign: str = "") -> str:  # a decimal only where it fits and matters
        return f"{x:{sign}.1f}" if rule.unit > 1 and abs(x) < 100 else f"{x:{sign}.0f}"

    return f"{short(per_h, '+')}+-{short(half)}"


def _growing(trend: Trend, rule: Rule) -> str:
    slope = trend.slope
    assert slope is not None
    unit = "MiB/h" if rule.unit > 1 else "/h"
    low, high = slope.low_per_s * 3600 / rule.unit, slope.high_per_s * 3600 / rule.unit
    bound = rule.trend.max_per_h / rule.unit
    return (
        f"grows {slope.per_h / rule.unit:+.1f} {unit} (95% interval {low:+.1f} to {high:+.1f}) over the "
        f"last {slope.window_s / 60:.1f} min of the churn, faster than the {bound:.0f} {unit} a process "
        "that runs for weeks can afford"
    )
