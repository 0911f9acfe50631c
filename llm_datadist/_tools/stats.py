"""`llm-datadist stats`: one line per live instance of this user (role, cluster id, pid, links, caches,
pool bytes in use, transfers, bytes moved, failures), read from their stats segments without waking any
of them; `--json` for machines, `--watch` to refresh with rates like `top`.

Rules: only figures the stats segments hold (docs/metrics.md); rates are differences between two readings
of the same segment divided by the time between them, so the first table of a watch has none.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from llm_datadist._shm.space import format_nbytes
from llm_datadist._shm.stats import StatsReading, list_stats
from llm_datadist._stats import (
    BUCKETS,
    GENERATIONS,
    OPERATIONS,
    ROLE_HIXL,
    bucket_names,
    operation_totals,
    role_name,
)

from .output import say

DESCRIPTION = (
    "Show what every live llm_datadist instance of this user moved: one line each with its role, cluster "
    "id, pid, links, caches, pool bytes in use, transfers, bytes moved and failures, read from the "
    "instances' stats segments in shared memory (nothing is asked of them). --json prints the same as JSON "
    "with every counter; --watch refreshes every few seconds with transfers and bytes per second, and "
    "--plot draws what a watch saw. "
    "LLM_DATADIST_STATS=0 in an instance's environment switches its counting off."
)


def _totals(reading: StatsReading) -> tuple[int, int, int]:
    """Transfers, bytes and failures of every kind."""
    rows = operation_totals(reading.slots).values()
    return (
        int(sum(row["transfers"] for row in rows)),
        int(sum(row["bytes"] for row in rows)),
        int(sum(row["failures"] for row in rows)),
    )


# What a watch read last: segment name -> (when, reading).
Previous = dict[str, tuple[float, StatsReading]]


def table(readings: Sequence[StatsReading], previous: Previous | None = None) -> list[str]:
    """The table's lines; with `previous` (name -> (when read, reading)), rates since then."""
    header = (
        f"{'pid':>8} {'role':<8} {'cluster':>8} {'links':>5} {'caches':>6} {'pool used':>10} "
        f"{'transfers':>10} {'moved':>10} {'failures':>8}"
    )
    lines = [header if previous is None else f"{header} {'per s':>8} {'GB/s':>7}"]
    now = time.monotonic()
    for reading in readings:
        transfers, nbytes, failures = _totals(reading)
        rate, gbps = "", ""
        if previous is not None and reading.name in previous:
            then, earlier = previous[reading.name]
            elapsed = now - then
            if elapsed > 0:
                before, before_bytes, _ = _totals(earlier)
                rate = f"{(transfers - before) / elapsed:.0f}"
                gbps = f"{(nbytes - before_bytes) / elapsed / 1e9:.2f}"
        gauges = reading.gauges
        # A hixl engine's cluster id is drawn from its address, not given: it means nothing to read.
        cluster = "-" if reading.role == ROLE_HIXL else reading.cluster_id
        line = (
            f"{reading.pid:>8} {role_name(reading.role):<8} {cluster:>8} "
            f"{gauges.get('links', 0):>5} {gauges.get('caches', 0):>6} "
            f"{format_nbytes(gauges.get('pool_used_bytes', 0)):>10} "
            f"{transfers:>10} {format_nbytes(nbytes):>10} {failures:>8}"
        )
        lines.append(line if previous is None else f"{line} {rate:>8} {gbps:>7}")
    lines.append(f"{len(readings)} live instance(s)")
    return lines


def as_json(readings: Sequence[StatsReading]) -> str:
    items: list[dict[str, Any]] = []
    for reading in readings:
        transfers, nbytes, failures = _totals(reading)
        items.append(
            {
                "pid": reading.pid,
                "role": role_name(reading.role),
                "cluster_id": reading.cluster_id,
                "segment": reading.name,
                "created_ns": reading.created_ns,
                "transfers": transfers,
                "bytes": nbytes,
                "failures": failures,
                "gauges": reading.gauges,
                "counters": reading.slots,
            }
        )
    return json.dumps({"instances": items}, indent=2)


def _warn(line: str) -> None:
    """A segment left out (another process wrote something unsound into it): said on stderr, once."""
    print(f"llm-datadist stats: {line}", file=sys.stderr)


def _readings(args: argparse.Namespace) -> list[StatsReading]:
    """The live instances, those of `--pid` and `--cluster` only when given."""
    return [
        reading
        for reading in list_stats(say=_warn)
        if (args.pid is None or reading.pid == args.pid)
        and (args.cluster is None or reading.cluster_id == args.cluster)
    ]


def run(args: argparse.Namespace) -> int:
    if args.plot and args.watch is None:
        print("llm-datadist stats: --plot draws what a --watch saw; give --watch SECONDS", file=sys.stderr)
        return 2
    if args.json:
        say(as_json(_readings(args)))
        return 0
    if args.watch is None:
        for line in table(_readings(args)):
            say(line)
        return 0
    previous: Previous = {}
    history: list[tuple[float, list[StatsReading]]] = []
    shown = 0
    started = time.monotonic()
    try:
        while args.count is None or shown < args.count:
            if shown:
                time.sleep(args.watch)
            readings = _readings(args)
            lines = table(readings, previous)
            if args.count is None:
                say("\033[H\033[2J" + lines[0])  # clear the screen, as top does
                lines = lines[1:]
            for line in lines:
                say(line)
            now = time.monotonic()
            previous = {reading.name: (now, reading) for reading in readings}
            history.append((now - started, readings))
            shown += 1
    except KeyboardInterrupt:
        pass
    if args.plot:
        return plot(history, args.plot)
    return 0


def _p50_us(counts: Sequence[int]) -> float | None:
    """The upper bound, in us, of the histogram bucket that holds the median (None: no transfer)."""
    total = sum(counts)
    if total == 0:
        return None
    running = 0
    for i, count in enumerate(counts):
        running += count
        if 2 * running >= total:
            return float(1 << i)
    return float(1 << (len(counts) - 1))


def _histogram(reading: StatsReading) -> list[int]:
    """Every generation's and operation's duration buckets, added up."""
    counts = [0] * BUCKETS
    for generation in GENERATIONS:
        for operation in OPERATIONS:
            for i, name in enumerate(bucket_names(f"{generation}.{operation}")):
                counts[i] += reading.slots.get(name, 0)
    return counts


def plot(history: Sequence[tuple[float, Sequence[StatsReading]]], path: str) -> int:
    """Throughput (GB/s) and the median transfer time (its histogram bucket, us) of every instance over
    the watch, a line each, into a PNG at `path` (the 'plot' extra: matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "llm-datadist stats --plot needs matplotlib: pip install 'llm-datadist-host[plot]'",
            file=sys.stderr,
        )
        return 2
    series: dict[str, tuple[str, list[float], list[float], list[float]]] = {}
    last: dict[str, tuple[float, StatsReading]] = {}
    for when, readings in history:
        for reading in readings:
            if reading.name in last:
                then, earlier = last[reading.name]
                label = f"{role_name(reading.role)} {reading.cluster_id} (pid {reading.pid})"
                _, times, gbps, p50 = series.setdefault(reading.name, (label, [], [], []))
                moved = _totals(reading)[1] - _totals(earlier)[1]
                deltas = [a - b for a, b in zip(_histogram(reading), _histogram(earlier), strict=True)]
                median = _p50_us(deltas)
                times.append(when)
                gbps.append(moved / max(when - then, 1e-9) / 1e9)
                p50.append(median if median is not None else float("nan"))
            last[reading.name] = (when, reading)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for label, times, gbps, p50 in series.values():
        top.plot(times, gbps, label=label)
        bottom.plot(times, p50, label=label)
    top.set_ylabel("GB/s")
    bottom.set_ylabel("median transfer (us, bucket)")
    bottom.set_yscale("log", base=2)
    bottom.set_xlabel("seconds")
    top.set_title("llm-datadist stats: what every instance moved")
    if series:
        top.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    say(f"plot written to {path}")
    return 0


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print every instance's figures as JSON")
    parser.add_argument("--pid", type=int, help="only the instances of process PID")
    parser.add_argument("--cluster", type=int, metavar="ID", help="only the instances of cluster ID")
    parser.add_argument(
        "--watch",
        type=_positive,
        metavar="SECONDS",
        help="refresh every SECONDS, with transfers and GB per second since the last table",
    )
    parser.add_argument("--count", type=_count, metavar="N", help="with --watch: print N tables, then stop")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="with --watch: when it ends, draw each instance's GB/s and median transfer time over the watch "
        "into a PNG (needs the 'plot' extra)",
    )
