"""`llm-datadist bench` as a user runs it (the quick sweep, JSON out), its peer rows (measured when the peer
is installed, otherwise a skipped row that says how to install it), its serving group, its summary of the
targets (bench/README.md's table), and `bench --hosts` at a tiny size. No timing is asserted: rows exist,
ratios are numbers, skips carry reasons."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llm_datadist._bench import peers, serving, suite
from llm_datadist._bench.proc import BLOCK_SIZES, Results, block_patterns, copy_kernel

CLI = [sys.executable, "-m", "llm_datadist._tools.cli"]
TARGET_KEYS = {
    "small_pull",
    "small_pull_us",
    "puller_cpu",
    "owner_cpu",
    f"layers.{1 << 20}",
    *(f"blocks.{n}" for n in BLOCK_SIZES),
    "one_sided_64k_vs_nixl",
    "one_sided_1m",
    "one_sided_16m",
    f"large.pull.whole.{16 << 20}",
    "p99",
    "serving.small_us",
    "serving.small_vs_rtt",
    "serving.small_puller_cpu",
    "serving.small_owner_cpu",
    *(f"serving.request.{n}" for n in serving.REQUEST_SLOTS),
    "serving.layers.cache_key",
    "serving.layers.by_id",
    "serving.v2_paged.library.1",
    "serving.v2_paged.library.8",
    "serving.v2_paged.library.64",
    "serving.v2_paged.private.8",
    "serving.p99",
}
# Targets that need what this machine may not have: NIXL, the library's allocator of shareable memory.
MAY_BE_NA = {"one_sided_64k_vs_nixl", *(f"serving.v2_paged.library.{n}" for n in serving.PAGED_TABLES)}


def _number(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_quick_bench_reports_every_group_and_leaves_nothing(tmp_path: Path) -> None:
    # No /dev/shm entry left: the autouse fixture checks (the bench's processes are dead by then; an entry
    # of another session running at the same time is not ours to judge).
    out = tmp_path / "run.json"
    result = subprocess.run(
        [*CLI, "bench", "--quick", "--quiet", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    rows: list[dict[str, Any]] = report["rows"]
    groups = {row["group"] for row in rows}
    assert groups >= {
        "memcpy",
        "baseline",
        "peer",
        "serving",
        "pull_cache",
        "layers",
        "latency",
        "blocks",
        "one-sided",
    }
    for row in rows:
        if "skipped" in row:
            assert row["skipped"].strip(), row
        else:
            assert row["p50_us"] > 0 and row["p99_us"] >= row["p50_us"] and row["samples"] >= 3, row
            if row["nbytes"]:
                assert _number(row["x_memcpy"]), row
    by_id = {row["id"]: row for row in rows if "id" in row}
    # The pull's breakdown is printed when the core records one; its phases are the core's to name.
    for row in rows:
        if "breakdown_us" in row:
            assert row["breakdown_us"] and all(v >= 0 for v in row["breakdown_us"].values())
    # Layer by layer against one whole pull of the same bytes, with the ratio.
    whole, by_layer = by_id[f"layers.whole.{1 << 20}"], by_id[f"layers.by_layer.{1 << 20}"]
    assert whole["nbytes"] == by_layer["nbytes"] == 64 << 20
    assert _number(by_layer["vs_whole"])
    assert _number(by_id[f"pull.whole.{64 << 10}"]["x_memcpy"])
    # The block pattern: ours and each peer's, per block size, measured or skipped with the reason.
    for pattern in block_patterns(quick=True):
        ours = by_id[f"blocks.ours.{pattern.block_nbytes}"]
        assert ours["nbytes"] == pattern.nbytes and _number(ours["x_memcpy"])
        for _, _, _, peer in peers.PEERS:
            row = by_id[f"blocks.{peer}.{pattern.block_nbytes}"]
            assert row["group"] == "blocks"
            assert row.get("skipped") or (row["nbytes"] == pattern.nbytes and _number(row["x_memcpy"]))
    _check_serving_rows(by_id)
    # The summary of the targets, in the JSON and at the end of the report.
    targets = {target["key"]: target for target in report["targets"]}
    assert set(targets) == TARGET_KEYS
    for target in targets.values():
        assert target["result"] in {"PASS", "MISS", "n/a"} and target["detail"], target
        if target["result"] == "n/a":
            assert target["measured"] is None
        else:  # a figure of 0 is possible (the owner spends no CPU on a pull that needs no RPC)
            assert math.isfinite(target["measured"]) and target["measured"] >= 0, target
    for key in TARGET_KEYS - MAY_BE_NA:
        assert targets[key]["result"] != "n/a", targets[key]
    assert "x memcpy: ratio to the best copy of this run" in result.stdout
    # The yardstick is the faster of the two 2-thread copies: numpy.copyto and, where built, the kernel.
    copies = {row["name"]: row for row in rows if row.get("group") == "memcpy" and row.get("gbps")}
    assert "numpy.copyto, 2 threads" in copies
    if copy_kernel() is not None:
        assert "copy kernel, streaming stores, 2 threads" in copies
    else:
        assert any(row.get("skipped") for row in rows if row["name"].startswith("copy kernel"))
    # The copies alone that the targets name as what limits a row: shared memory, the paged blocks.
    for row_id in ("memcpy.shared", *(f"memcpy.scattered.{count}" for count in (1, 8, 64))):
        row = by_id[row_id]
        assert row["group"] == "memcpy" and (row.get("skipped") or _number(row["x_memcpy"])), row
        assert bool(row.get("skipped")) == (copy_kernel() is None), row
    assert by_id["memcpy.scattered.8"].get("skipped") or by_id["memcpy.scattered.8"]["nbytes"] == 16 << 20
    summary = result.stdout.split("performance targets (the table in bench/README.md), ratios from this run")[
        1
    ]
    assert all(target["target"] in summary for target in targets.values())


def _check_serving_rows(by_id: dict[str, dict[str, Any]]) -> None:
    """The serving group: every row a real client's call sequence, with p50, p99, the puller's CPU per pull
    and the owner's, measured or skipped with the reason."""
    measured = [
        "serving.small",
        *(f"serving.request.{n}" for n in serving.REQUEST_SLOTS),
        "serving.layers.whole",
        "serving.layers.cache_key",
        "serving.layers.by_id",
        *(f"serving.v1_blocks.{n}" for n in serving.PAGED_TABLES),
        *(f"serving.v2_paged.private.{n}" for n in serving.PAGED_TABLES),
    ]
    for row_id in measured:
        row = by_id[row_id]
        assert row["group"] == "serving" and "skipped" not in row, row
        assert set(row["cpu_us"]) == {"puller", "owner"}, row
        assert all(math.isfinite(v) and v >= 0 for v in row["cpu_us"].values()), row
        assert row["cpu_us"]["puller"] > 0, row
    assert by_id["serving.small"]["nbytes"] == serving.SMALL_NBYTES
    for n in serving.REQUEST_SLOTS:
        assert by_id[f"serving.request.{n}"]["nbytes"] == serving.TENSORS * n
    for name in ("cache_key", "by_id"):
        row = by_id[f"serving.layers.{name}"]
        assert row["nbytes"] == by_id["serving.layers.whole"]["nbytes"] == 16 << 20
        assert _number(row["vs_whole"])
    for n in serving.PAGED_TABLES:
        assert by_id[f"serving.v1_blocks.{n}"]["nbytes"] == serving.TENSORS * n * serving.PAGED_BLOCK
        assert by_id[f"serving.v2_paged.private.{n}"]["nbytes"] == serving.TENSORS * n * serving.PAGED_BLOCK
        library = by_id[f"serving.v2_paged.library.{n}"]
        assert library["group"] == "serving"
        assert library.get("skipped") or library["nbytes"] == serving.TENSORS * n * serving.PAGED_BLOCK
    assert by_id["serving.hosts"]["skipped"].startswith("measured by `llm-datadist bench --hosts`")


def test_each_peer_is_measured_or_skipped_with_the_way_to_install_it() -> None:
    results = Results(quiet=True)
    patterns = block_patterns(quick=True)
    peers.run(results, lambda nbytes: 3, patterns)
    for label, module, hint, peer in peers.PEERS:
        rows = [row for row in results.rows if row["group"] == "peer" and row["name"].startswith(label)]
        blocks = [row for row in results.rows if row.get("id", "").startswith(f"blocks.{peer}.")]
        ids = [row["id"] for row in blocks if not row["id"].endswith(".split")]  # .split: a fallback
        assert ids == [f"blocks.{peer}.{p.block_nbytes}" for p in patterns]
        if importlib.util.find_spec(module.split(".")[0]) is None:
            reason = f"not installed (ModuleNotFoundError); {hint}"
            assert rows == [{"group": "peer", "name": label, "skipped": reason, "id": f"peer.{peer}"}]
            assert all(row["skipped"] == reason for row in blocks)
        elif "skipped" in rows[0]:  # installed, but cannot run on this machine: the row says why
            assert rows[0]["skipped"].startswith("installed, but failed here: "), rows[0]
            assert all(row["skipped"] == rows[0]["skipped"] for row in blocks)
        else:
            assert [row["nbytes"] for row in rows] == list(peers.SIZES)
            assert all(row["samples"] == 3 for row in rows)
            for row, pattern in zip([r for r in blocks if r["id"] in ids], patterns, strict=True):
                if "skipped" in row:  # this pattern failed here (the one-sided reads did not)
                    assert row["skipped"].startswith("installed, but failed here: ")
                else:
                    assert row["nbytes"] == pattern.nbytes and row["samples"] == 3


def _row(results: Results, group: str, row_id: str, nbytes: int, p50_s: float, **extra: Any) -> None:
    results.add(group, row_id, nbytes, [p50_s] * 100, id=row_id, **extra)


def test_the_targets_judge_each_ratio_and_say_what_is_missing() -> None:
    results = Results(quiet=True)
    results.add("memcpy", "numpy.copyto, 2 threads", 1 << 30, [0.1])  # the reference: 10.7 GB/s
    _row(results, "baseline", "baseline.msgpack", 0, 30e-6)
    _row(results, "latency", "latency.small", 4096, 7e-6, cpu_us={"this process": 9.0, "the other": 0.1})
    _row(results, "pull_cache", f"pull.whole.{16 << 20}", 512 << 20, (512 << 20) / 10.2e9)  # 0.95 x
    _row(results, "layers", f"layers.whole.{1 << 20}", 64 << 20, 0.004)
    _row(results, "layers", f"layers.by_layer.{1 << 20}", 64 << 20, 0.0044, vs_whole=0.9)
    results.skip("blocks", "ours", "failed", id=f"blocks.ours.{16 << 10}")
    _row(results, "one-sided", f"one_sided.registered.{64 << 10}", 64 << 10, 20e-6)
    suite._with_ratios(results)
    targets = {target["key"]: target for target in suite._targets(results)}
    assert targets["small_pull"]["result"] == "PASS" and targets["small_pull"]["measured"] == 7 / 30
    assert targets["small_pull_us"]["result"] == "PASS"
    assert targets["puller_cpu"]["result"] == "MISS" and targets["puller_cpu"]["measured"] == 9.0
    assert targets["owner_cpu"]["result"] == "PASS" and targets["owner_cpu"]["measured"] == 0.1
    assert targets[f"layers.{1 << 20}"]["result"] == "PASS"
    assert targets[f"large.pull.whole.{16 << 20}"]["result"] == "PASS"
    assert (
        targets[f"blocks.{16 << 10}"] | {"result": "n/a", "detail": "failed", "measured": None}
        == (targets[f"blocks.{16 << 10}"])
    )
    assert targets[f"blocks.{64 << 10}"]["detail"] == "not measured in this run"
    assert targets["one_sided_64k_vs_nixl"]["result"] == "n/a"
    assert targets["one_sided_1m"]["result"] == "n/a" and targets["one_sided_16m"]["result"] == "n/a"
    assert targets["p99"]["result"] == "PASS" and targets["p99"]["measured"] == 1.0
    # The serving targets: none of their rows is here, so each is n/a and says so.
    assert all(
        target["result"] == "n/a" and target["detail"]
        for key, target in targets.items()
        if key.startswith("serving.")
    )


def test_the_serving_targets_are_judged_on_the_serving_rows() -> None:
    results = Results(quiet=True)
    results.add("memcpy", "numpy.copyto, 2 threads", 1 << 30, [0.1])  # the reference: 10.7 GB/s
    _row(results, "baseline", "baseline.msgpack", 0, 30e-6)
    cpu = {"puller": 12.0, "owner": 0.0}
    _row(results, "serving", "serving.small", 4096, 9e-6, cpu_us=cpu)
    _row(results, "serving", f"serving.request.{2 << 20}", 128 << 20, (128 << 20) / 5.4e9)  # 0.5 x
    _row(results, "serving", "serving.layers.whole", 16 << 20, 0.002)
    _row(results, "serving", "serving.layers.cache_key", 16 << 20, 0.004, vs_whole=0.5)
    _row(results, "serving", "serving.layers.by_id", 16 << 20, 0.0021, vs_whole=0.95)
    results.skip("serving", "library", "no allocator", id="serving.v2_paged.library.8")
    _row(results, "serving", "serving.v2_paged.library.64", 128 << 20, (128 << 20) / 7.5e9)  # 0.7 x
    _row(results, "memcpy", "memcpy.shared", 1 << 30, 0.125)  # 0.8 x
    _row(results, "memcpy", "memcpy.scattered.64", 128 << 20, (128 << 20) / 8.0e9)  # 0.75 x
    _row(results, "serving", "serving.v2_paged.private.8", 16 << 20, (16 << 20) / 6.4e9)  # 0.6 x
    # A row with a long tail: p99 / p50 = 4.
    results.add("serving", "tail", 2 << 20, [1e-3] * 90 + [4e-3] * 10, id="serving.v1_blocks.1")
    suite._with_ratios(results)
    targets = {target["key"]: target for target in suite._targets(results)}
    assert targets["serving.small_us"]["result"] == "PASS" and targets["serving.small_us"]["measured"] == 9.0
    assert targets["serving.small_vs_rtt"]["result"] == "MISS"
    assert targets["serving.small_puller_cpu"]["result"] == "MISS"
    assert targets["serving.small_owner_cpu"]["result"] == "PASS"
    assert targets[f"serving.request.{2 << 20}"]["result"] == "MISS"
    assert targets[f"serving.request.{32 << 10}"]["result"] == "n/a"
    assert targets["serving.layers.cache_key"]["result"] == "MISS"
    assert targets["serving.layers.by_id"]["result"] == "PASS"
    assert targets["serving.v2_paged.library.8"]["result"] == "n/a"
    assert targets["serving.v2_paged.library.8"]["detail"] == "no allocator"
    assert targets["serving.v2_paged.private.8"]["result"] == "PASS"
    # A miss names the copy alone of what its row copies, from the same run.
    assert targets[f"serving.request.{2 << 20}"]["detail"].endswith(
        "(the copy alone: 0.80, 2 threads between two segments of shared memory)"
    )
    library = targets["serving.v2_paged.library.64"]
    assert library["result"] == "MISS"
    assert "(the copy alone: 0.75, the same random blocks" in library["detail"]
    assert targets["serving.p99"]["result"] == "MISS" and targets["serving.p99"]["measured"] == 4.0


def test_hosts_bench_reports_every_kind_with_its_ratios(tmp_path: Path) -> None:
    from llm_datadist._bench.hosts import GROUPS, KINDS, MOONCAKE_KINDS
    from llm_datadist._tools.netns import hosts_unavailable, netns_list

    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "hosts.json"
    command = [*CLI, "bench", "--hosts", "--quick", "--quiet", "--hosts-mib", "2", "--json", str(out)]
    # No /dev/shm entry left: the autouse fixture checks (its owners, the bench's children, are dead by then).
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=300)
        finally:
            process.kill()
    assert process.returncode == 0, stdout + stderr
    report = json.loads(out.read_text())
    assert report["hosts"]["ip_a"] != report["hosts"]["ip_b"]
    by_id = {row["id"]: row for row in report["rows"]}
    wanted = {f"hosts.ours.{kind}" for kind in KINDS} | {f"hosts.mooncake.{kind}" for kind in MOONCAKE_KINDS}
    wanted |= {f"hosts.{group}.{kind}" for group in ("tcp", "memcpy") for kind in ("bulk", "small")}
    assert set(by_id) == wanted
    for row in report["rows"]:
        assert row["group"] in GROUPS
        assert row["p50_us"] > 0 and row["p99_us"] >= row["p50_us"] and row["samples"] >= 3, row
        assert _number(row["gbps"]), row
        ratios = {key for key in row if key.startswith("x_")}
        assert ratios == ({"x_mooncake", "x_tcp", "x_memcpy"} if row["group"] == "ours" else set()), row
        assert all(_number(row[key]) for key in ratios), row
    assert by_id["hosts.ours.whole"]["nbytes"] == by_id["hosts.mooncake.whole"]["nbytes"] == 2 << 20
    assert by_id["hosts.ours.blocks"]["nbytes"] == by_id["hosts.mooncake.blocks"]["nbytes"] == 2 << 20
    assert by_id["hosts.ours.small"]["nbytes"] == by_id["hosts.tcp.small"]["nbytes"] == 4096
    assert by_id["hosts.ours.fresh"]["nbytes"] == 4096
    assert "two network namespaces joined by a veth pair" in stdout
    assert not [name for name in netns_list() if name.startswith(f"llmdd-{process.pid}-")]
