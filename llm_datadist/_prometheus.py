"""The stats segments as Prometheus metrics (the optional `prometheus` extra: the official
`prometheus_client`): a collector that reads segments at every scrape, for `llm-datadist exporter` (every
live instance of this user) and for `llm_datadist.ext.register_prometheus` (this process's own, into a
registry the application already serves).

Rules: names under one prefix, `llm_datadist_`, with the field's conventions (`_total` counters, `_bytes`
and `_seconds` units, a histogram of transfer durations in seconds); every sample carries the instance's
`pid`, `role` and `cluster_id`. Nothing here writes a segment or wakes its writer. docs/metrics.md lists
every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from llm_datadist._shm.stats import StatsReading

from ._stats import BUCKETS, GENERATIONS, OPERATIONS, TRANSPORTS, bucket_names, role_name
from ._wire.door import REFUSAL_CAUSES

PREFIX = "llm_datadist_"
_INSTANCE = ("pid", "role", "cluster_id")
_KIND = (*_INSTANCE, "generation", "operation", "transport")
_TIMING = (*_INSTANCE, "generation", "operation")
_GAUGES = {
    "caches": ("caches", "caches the instance holds (allocated, registered, or kept by a key)"),
    "pool_used_bytes": ("pool_used_bytes", "bytes of the instance's memory pools in use"),
    "leases": ("leases", "leases peers hold on the instance's memory (their transfers in flight)"),
    "pins": ("local_pins", "the instance's own transfers in flight on its caches"),
    "links": ("links", "links the instance holds"),
}
# Gauges of the segment that only grow: counters to Prometheus.
_GROWING = {
    "index_lock_waits": ("index_lock_waits", "waits of this process for an index lock held elsewhere")
}


def metric_families(readings: Sequence[StatsReading]) -> Iterator[Any]:
    """The metric families of these readings (`prometheus_client.core` families)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    transfers = CounterMetricFamily(PREFIX + "transfers", "transfers that ended well", labels=_KIND)
    nbytes = CounterMetricFamily(PREFIX + "bytes", "bytes the transfers that ended well moved", labels=_KIND)
    runs = CounterMetricFamily(
        PREFIX + "runs", "contiguous byte runs (descriptors) the transfers moved", labels=_KIND
    )
    seconds = HistogramMetricFamily(
        PREFIX + "transfer_seconds", "how long the transfers that ended well took", labels=_TIMING
    )
    failed = CounterMetricFamily(PREFIX + "transfer_failures", "transfers that failed", labels=_TIMING)
    by_status = CounterMetricFamily(
        PREFIX + "failures",
        "failed transfers by the status code they reported",
        labels=(*_INSTANCE, "status"),
    )
    made = CounterMetricFamily(PREFIX + "links_made", "links the instance made", labels=_INSTANCE)
    broken = CounterMetricFamily(PREFIX + "links_broken", "links the instance found broken", labels=_INSTANCE)
    restarts = CounterMetricFamily(
        PREFIX + "peer_restarts_seen",
        "peers linked to again under their cluster id that had restarted meanwhile",
        labels=_INSTANCE,
    )
    refused = CounterMetricFamily(
        PREFIX + "links_refused", "links the instance refused, by cause", labels=(*_INSTANCE, "cause")
    )
    keys = {
        kind: CounterMetricFamily(PREFIX + f"keys_{kind}", text, labels=_INSTANCE)
        for kind, text in (
            ("published", "cache keys the instance bound"),
            ("removed", "cache keys its user removed"),
            ("consumed", "cache keys pulls consumed"),
        )
    }
    gauges = {
        key: GaugeMetricFamily(PREFIX + name, text, labels=_INSTANCE) for key, (name, text) in _GAUGES.items()
    }
    growing = {
        key: CounterMetricFamily(PREFIX + name, text, labels=_INSTANCE)
        for key, (name, text) in _GROWING.items()
    }
    bounds = [f"{(1 << i) / 1e6:g}" for i in range(BUCKETS - 1)] + ["+Inf"]
    for reading in readings:
        slots = reading.slots
        instance = [str(reading.pid), role_name(reading.role), str(reading.cluster_id)]
        for generation in GENERATIONS:
            for operation in OPERATIONS:
                prefix = f"{generation}.{operation}"
                for transport in TRANSPORTS:
                    labels = [*instance, generation, operation, transport]
                    transfers.add_metric(labels, slots.get(f"{prefix}.{transport}.transfers", 0))
                    nbytes.add_metric(labels, slots.get(f"{prefix}.{transport}.bytes", 0))
                    runs.add_metric(labels, slots.get(f"{prefix}.{transport}.runs", 0))
                counts = [slots.get(name, 0) for name in bucket_names(prefix)]
                cumulative, total = [], 0
                for bound, count in zip(bounds, counts, strict=True):
                    total += count
                    cumulative.append((bound, total))
                labels = [*instance, generation, operation]
                seconds.add_metric(labels, cumulative, slots.get(f"{prefix}.seconds_sum_ns", 0) / 1e9)
                failed.add_metric(labels, slots.get(f"{prefix}.failures", 0))
        for name, value in slots.items():
            if name.startswith("status.") and value:
                by_status.add_metric([*instance, name.removeprefix("status.")], value)
        made.add_metric(instance, slots.get("events.links_made", 0))
        broken.add_metric(instance, slots.get("events.links_broken", 0))
        restarts.add_metric(instance, slots.get("events.peer_restarts_seen", 0))
        for cause in REFUSAL_CAUSES:
            refused.add_metric([*instance, cause], slots.get(f"events.links_refused_{cause}", 0))
        for kind, counter in keys.items():
            counter.add_metric(instance, slots.get(f"events.keys_{kind}", 0))
        for key, gauge in gauges.items():
            gauge.add_metric(instance, reading.gauges.get(key, 0))
        for key, counter in growing.items():
            counter.add_metric(instance, reading.gauges.get(key, 0))
    yield from (
        transfers,
        nbytes,
        runs,
        seconds,
        failed,
        by_status,
        made,
        broken,
        restarts,
        refused,
        *keys.values(),
    )
    yield from gauges.values()
    yield from growing.values()


class Collector:
    """A `prometheus_client` collector of the readings `read` gives at each scrape."""

    def __init__(self, read: Callable[[], Sequence[StatsReading]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Any]:
        return metric_families(self._read())

    def describe(self) -> list[Any]:
        return []  # the families depend on what is read: describe nothing, collect at each scrape
