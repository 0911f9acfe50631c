"""The report of `llm-datadist bench` (`suite`): the table of a run's rows, the performance targets (the
table in bench/README.md) judged against them, the JSON file and the plot.

Rules: it measures nothing and reads only the rows (`proc.Results`); it finds a figure by its row's `id`, so
the ids `suite` gives are this module's interface. A target whose row is missing is n/a, with the reason.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .proc import Results, fmt_nbytes

__all__ = ["GROUPS", "OURS", "judge_targets", "plot", "print_report", "with_ratios", "write_json"]


# The copy kernel's streaming copy, measured beside numpy.copyto: the best copy one process can make.
KERNEL_COPY = "copy kernel, streaming stores"
_TWO_THREAD_COPIES = ("numpy.copyto, 2 threads", f"{KERNEL_COPY}, 2 threads")


def reference_row(results: Results) -> dict[str, Any] | None:
    """The yardstick: the faster, at the largest size measured, of the two 2-thread copies of this run
    (numpy.copyto stores through the cache, the kernel streams around it, and which one wins depends on
    the machine). Smaller copies can stay in the L3 cache (300 MiB on the development machine) and would
    overstate what memory can do."""
    copies = [r for r in results.rows if r.get("name") in _TWO_THREAD_COPIES and r.get("gbps")]
    if not copies:
        return None
    largest = max(r["nbytes"] for r in copies)
    return max((r for r in copies if r["nbytes"] == largest), key=lambda r: float(r["gbps"]))


def _reference_gbps(results: Results) -> float | None:
    row = reference_row(results)
    return float(row["gbps"]) if row is not None else None


# The report's order: rows of one group together, in this order; a group's rows in the order measured,
# except "blocks", where each of our pull_blocks rows is followed by the peers' rows of the same pattern.
GROUPS = ("memcpy", "baseline", "peer", "serving", "pull_cache", "layers", "latency", "blocks", "one-sided")


def _ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def place(item: tuple[int, dict[str, Any]]) -> tuple[int, int, int, int]:
        index, row = item
        group = GROUPS.index(row["group"]) if row["group"] in GROUPS else len(GROUPS)
        if row["group"] != "blocks":
            return (group, 0, 0, index)
        return (
            group,
            row.get("block_nbytes", 0),
            0 if row.get("id", "").startswith("blocks.ours.") else 1,
            index,
        )

    return [row for _, row in sorted(enumerate(rows), key=place)]


def with_ratios(results: Results) -> None:
    """Each row with a throughput gets `x_memcpy`: its GB/s over the run's reference copy."""
    reference = _reference_gbps(results)
    for row in results.rows:
        if row.get("gbps") and reference:
            row["x_memcpy"] = row["gbps"] / reference


def print_report(results: Results, targets: list[dict[str, Any]]) -> None:
    """The table of the rows, then the targets, on stdout."""
    columns = ("group", "benchmark", "size", "GB/s", "p50 us", "p99 us", "x memcpy")
    header = "{:<10} {:<56} {:>9} {:>7} {:>10} {:>10} {:>9}".format(*columns)
    print(header)
    print("-" * len(header))
    for row in _ordered(results.rows):
        if "skipped" in row:
            print(f"{row['group']:<10} {row['name']:<56} skipped: {row['skipped']}")
            continue
        gbps = row["gbps"]
        ratio = f"{row['x_memcpy']:9.2f}" if "x_memcpy" in row else f"{'':>9}"
        gbps_text = f"{gbps:7.2f}" if gbps else f"{'':>7}"
        print(
            f"{row['group']:<10} {row['name']:<56} {fmt_nbytes(row['nbytes']):>9} {gbps_text} "
            f"{row['p50_us']:10.1f} {row['p99_us']:10.1f} {ratio}"
        )
        breakdown = row.get("breakdown_us")
        if breakdown:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in breakdown.items())
            print(f"{'':<10}   where the time goes (median us): {parts}")
        cpu = row.get("cpu_us")
        if cpu:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
            print(f"{'':<10}   CPU per call (mean us, all threads): {parts}")
        if "vs_whole" in row:
            print(
                f"{'':<10}   x the whole pull of the same bytes (p50s, in alternation): {row['vs_whole']:.2f}"
            )
        if "vs_counted" in row:
            print(
                f"{'':<10}   p50 / the same pull's p50 with the stats counting (in alternation): "
                f"{row['vs_counted']:.2f}"
            )
    best = reference_row(results)
    if best is not None:
        print(
            f"x memcpy: ratio to the best copy of this run, {best['name']} of {fmt_nbytes(best['nbytes'])} "
            f"({float(best['gbps']):.2f} GB/s; the faster of numpy.copyto and the copy kernel's streaming "
            "copy, 2 threads each)"
        )
    print()
    print("performance targets (the table in bench/README.md), ratios from this run")
    header = f"{'target':<62} {'wanted':>8} {'measured':>9}  result"
    print(header)
    print("-" * (len(header) + 2))
    for target in targets:
        measured = f"{target['measured']:9.2f}" if target["measured"] is not None else f"{'-':>9}"
        wanted = f"{target['op']} {target['limit']:g}"
        print(f"{target['target']:<62} {wanted:>8} {measured}  {target['result']:<4}  {target['detail']}")


_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
}


def _copied_alone(row_id: str) -> str:
    """What a copy-alone row (`suite._ceiling_step`: "memcpy.shared", "memcpy.scattered.N") copies, as a
    target's detail names it."""
    if row_id == "memcpy.shared":
        return "2 threads between two segments of shared memory"
    return "the same random blocks between two segments"


def judge_targets(results: Results, layer_slices: Sequence[int]) -> list[dict[str, Any]]:
    """The performance targets (bench/README.md's table) against this run's rows (after `with_ratios`):
    each with a stable `key`, the measured figure, the limit, and PASS or MISS; n/a, with the reason in
    `detail`, where a row it needs is missing (a peer not installed, a row a quick run leaves out).
    `layer_slices`: the request sizes whose layer-by-layer pulls the run measured."""
    rows = {row["id"]: row for row in results.rows if "id" in row and "skipped" not in row}
    skipped = {row["id"]: row["skipped"] for row in results.rows if "id" in row and "skipped" in row}
    targets: list[dict[str, Any]] = []

    def target(key: str, text: str, op: str, limit: float, measured: float | None, detail: str) -> None:
        passed = measured is not None and _COMPARE[op](measured, limit)
        result = "n/a" if measured is None else "PASS" if passed else "MISS"
        targets.append(
            {
                "key": key,
                "target": text,
                "op": op,
                "limit": limit,
                "measured": measured,
                "result": result,
                "detail": detail,
            }
        )

    def x_memcpy(key: str, text: str, row_id: str, limit: float, ceiling: str = "") -> None:
        """`ceiling`: the id of the copy kernel's row ("memcpy.shared", "memcpy.scattered.8") that copies
        what the row copies with nothing around it, whose ratio the detail then gives."""
        row = rows.get(row_id)
        measured = row.get("x_memcpy") if row else None
        if row is None:
            detail = skipped.get(row_id, "not measured in this run")
        elif measured is None:
            detail = "no memcpy reference in this run"
        else:
            detail = f"{row['group']} {row['name']}, {fmt_nbytes(row['nbytes'])}"
            alone = rows.get(ceiling, {}).get("x_memcpy")
            if alone is not None:
                detail += f" (the copy alone: {alone:.2f}, {_copied_alone(ceiling)})"
        target(key, text, ">=", limit, measured, detail)

    _serving_targets(rows, skipped, target, x_memcpy)
    # The microbenchmark: the same small pull repeated with the same objects (a prefix key, never consumed).
    small, rtt = rows.get("latency.small"), rows.get("baseline.msgpack")
    text = "microbenchmark: repeated small pull p50 / msgpack round trip"
    if small and rtt:
        detail = f"{small['p50_us']:.1f} us against {rtt['p50_us']:.1f} us"
        target("small_pull", text, "<=", 0.25, small["p50_us"] / rtt["p50_us"], detail)
    else:
        target("small_pull", text, "<=", 0.25, None, "not measured in this run")
    target(
        "small_pull_us",
        "microbenchmark: repeated small pull p50, us",
        "<=",
        8,
        small["p50_us"] if small else None,
        "pull_cache by a prefix key, the same pull repeated" if small else "not measured in this run",
    )
    for key, who, text, cpu_limit in (
        ("puller_cpu", "this process", "microbenchmark: puller's CPU per repeated small pull, us", 8),
        ("owner_cpu", "the other", "microbenchmark: owner's CPU per repeated small pull, us", 1),
    ):
        cpu = small.get("cpu_us", {}).get(who) if small else None
        detail = "all its threads, from the scheduler's counters" if cpu is not None else "not measured"
        target(key, text, "<=" if key == "puller_cpu" else "<", cpu_limit, cpu, detail)
    for slice_nbytes in layer_slices:
        by_layer, whole = (
            rows.get(f"layers.by_layer.{slice_nbytes}"),
            rows.get(f"layers.whole.{slice_nbytes}"),
        )
        if by_layer is None or whole is None:
            continue  # the quick run measures one request size
        target(
            f"layers.{slice_nbytes}",
            f"layer by layer (32 pulls) / whole, {fmt_nbytes(by_layer['nbytes'])} request",
            ">=",
            0.9,
            by_layer["vs_whole"],
            f"p50 {by_layer['p50_us']:.0f} us against {whole['p50_us']:.0f} us",
        )
    for block_nbytes, limit in ((16 << 10, 0.8), (64 << 10, 0.9), (256 << 10, 0.9)):
        text = f"pull_blocks {block_nbytes >> 10} KiB blocks x 64 tensors / memcpy"
        x_memcpy(f"blocks.{block_nbytes}", text, f"blocks.ours.{block_nbytes}", limit, "memcpy.shared")
    # The one-sided rows read registered memory into registered memory, as the peers' rows do.
    ours, nixl = rows.get(f"one_sided.registered.{64 << 10}"), rows.get(f"peer.nixl.{64 << 10}")
    text = "one-sided 64 KiB p50 / NIXL's 64 KiB p50"
    if ours and nixl:
        detail = f"{ours['p50_us']:.1f} us against {nixl['p50_us']:.1f} us (registered -> registered)"
        target("one_sided_64k_vs_nixl", text, "<=", 1.0, ours["p50_us"] / nixl["p50_us"], detail)
    else:
        reason = "NIXL: " + skipped.get("peer.nixl", "not measured") if ours else "not measured in this run"
        target("one_sided_64k_vs_nixl", text, "<=", 1.0, None, reason)
    for nbytes, name in ((1 << 20, "1m"), (16 << 20, "16m")):
        text = f"one-sided {fmt_nbytes(nbytes)} (registered -> registered) / memcpy"
        x_memcpy(f"one_sided_{name}", text, f"one_sided.registered.{nbytes}", 0.9)
    for row_id, row in rows.items():
        if row_id.startswith("pull.whole.") and int(row_id.rsplit(".", 1)[1]) >= 16 << 20:
            x_memcpy(f"large.{row_id}", f"large pull, {row['name']} / memcpy", row_id, 0.9, "memcpy.shared")
    ours_rows = [r for r in results.rows if "skipped" not in r and r["group"] in OURS and r["samples"] >= 100]
    text = "p99 / p50, worst of our rows with >= 100 samples"
    if ours_rows:
        worst = max(ours_rows, key=lambda r: r["p99_us"] / r["p50_us"])
        detail = f"{worst['group']} {worst['name']}, {fmt_nbytes(worst['nbytes'])}"
        target("p99", text, "<=", 3, worst["p99_us"] / worst["p50_us"], detail)
    else:
        target("p99", text, "<=", 3, None, "not measured in this run")
    return targets


OURS = ("pull_cache", "layers", "latency", "one-sided")  # and our rows of "blocks" (too few samples for p99)
_SERVING_P99_SAMPLES = 20  # below this a row's p99 is its maximum


def _serving_targets(
    rows: dict[str, dict[str, Any]],
    skipped: dict[str, str],
    target: Callable[[str, str, str, float, float | None, str], None],
    x_memcpy: Callable[[str, str, str, float, str], None],
) -> None:
    """The targets judged on the `serving` rows (`serving.py`): pulls made as serving frameworks make them."""

    def missing(row_id: str) -> str:
        return skipped.get(row_id, "not measured in this run")

    small, rtt = rows.get("serving.small"), rows.get("baseline.msgpack")
    text = "fresh 1 x 4 KiB pull by CacheKey(req_id), consumed: p50, us"
    detail = "a new key per request, pulled once" if small else missing("serving.small")
    target("serving.small_us", text, "<=", 10, small["p50_us"] if small else None, detail)
    text = "the same: p50 / bare msgpack round trip p50"
    if small and rtt:
        detail = f"{small['p50_us']:.1f} us against {rtt['p50_us']:.1f} us"
        target("serving.small_vs_rtt", text, "<=", 0.25, small["p50_us"] / rtt["p50_us"], detail)
    else:
        target("serving.small_vs_rtt", text, "<=", 0.25, None, "not measured in this run")
    for key, who, text, op, cpu_limit in (
        ("serving.small_puller_cpu", "puller", "the same: puller's CPU per pull, us", "<=", 10.0),
        ("serving.small_owner_cpu", "owner", "the same: owner's CPU per pull, us", "<", 1.0),
    ):
        cpu = small.get("cpu_us", {}).get(who) if small else None
        detail = "all its threads, from the scheduler's counters" if cpu is not None else "not measured"
        target(key, text, op, cpu_limit, cpu, detail)
    for slot_nbytes, ratio in ((32 << 10, 0.6), (256 << 10, 0.85), (2 << 20, 0.9)):
        nbytes = fmt_nbytes(64 * slot_nbytes)
        text = f"fresh request, 64 x {fmt_nbytes(slot_nbytes)} ({nbytes}) / best copy"
        row_id = f"serving.request.{slot_nbytes}"
        x_memcpy(row_id, text, row_id, ratio, "memcpy.shared")
    whole = rows.get("serving.layers.whole")
    for name, key_name in (("cache_key", "CacheKey"), ("by_id", "CacheKeyByIdAndIndex")):
        row_id = f"serving.layers.{name}"
        row = rows.get(row_id)
        text = f"16 MiB by layer, new {key_name} each / whole"
        if row is None or whole is None:
            target(row_id, text, ">=", 0.9, None, missing(row_id))
            continue
        detail = f"p50 {row['p50_us']:.0f} us against {whole['p50_us']:.0f} us (32 pulls, in turn)"
        target(row_id, text, ">=", 0.9, row["vs_whole"], detail)
    library = rows.get("serving.v2_paged.library.1")
    text = "v2 paged, library memory, 1 block x 64 tensors: p50, us"
    detail = "one-sided, a new BlocksCacheKey" if library else missing("serving.v2_paged.library.1")
    alone = rows.get("memcpy.scattered.1")
    if library and alone:
        detail += f" (the copy alone: {alone['p50_us']:.0f} us, {_copied_alone('memcpy.scattered.1')})"
    target("serving.v2_paged.library.1", text, "<=", 150, library["p50_us"] if library else None, detail)
    for memory, table, ratio in (("library", 8, 0.7), ("library", 64, 0.8), ("private", 8, 0.5)):
        row_id = f"serving.v2_paged.{memory}.{table}"
        text = f"v2 paged, {memory} memory, {table} blocks x 64 tensors / best copy"
        x_memcpy(row_id, text, row_id, ratio, f"memcpy.scattered.{table}" if memory == "library" else "")
    serving = [r for r in rows.values() if r["group"] == "serving" and r["samples"] >= _SERVING_P99_SAMPLES]
    text = f"p99 / p50, worst serving row (>= {_SERVING_P99_SAMPLES} samples)"
    if serving:
        worst = max(serving, key=lambda r: r["p99_us"] / r["p50_us"])
        detail = f"{worst['name']}: {worst['p99_us']:.0f} / {worst['p50_us']:.0f} us"
        target("serving.p99", text, "<=", 3, worst["p99_us"] / worst["p50_us"], detail)
    else:
        target("serving.p99", text, "<=", 3, None, "not measured in this run")


def plot(results: Results, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[plot]')"
    rows = [
        r for r in _ordered(results.rows) if r.get("gbps") and r["group"] != "latency"
    ]  # latency: see the table
    groups = list(dict.fromkeys(r["group"] for r in rows))
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(rows) + 1.5))
    ax.barh(
        [f"{r['name']}, {fmt_nbytes(r['nbytes'])}" for r in rows],
        [r["gbps"] for r in rows],
        color=[colors(groups.index(r["group"]) % 10) for r in rows],
    )
    reference = _reference_gbps(results)
    if reference:
        ax.axvline(reference, color="black", linestyle="--", linewidth=1)
        ax.text(reference, -0.8, " best copy (the faster 2-thread copy)", fontsize=8, va="bottom")
    handles = [Rectangle((0, 0), 1, 1, color=colors(i % 10)) for i in range(len(groups))]
    ax.legend(handles, groups, loc="lower right", fontsize=8)
    ax.set_xlabel("GB/s (median of the run; one synchronous transfer at a time)")
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot written to {path}"


def write_json(path: str, results: Results, targets: list[dict[str, Any]]) -> str:
    """The machine, the rows (in the report's order) and the targets as JSON at `path`; what to print."""
    machine = {
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": sys.platform,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(
        json.dumps({"machine": machine, "rows": _ordered(results.rows), "targets": targets}, indent=2)
    )
    return f"JSON written to {path}"
