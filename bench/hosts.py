"""`llm-datadist bench --hosts`: our pulls between two network namespaces joined by a veth pair, beside two
raw Mooncake engines reading the same runs there, plain TCP between the same addresses, memcpy of the bytes.

Rules: owners live in namespace A, readers in B, each a spawned child that enters its namespace first; one
kind of transfer runs at a time; one transfer of each kind is checked before the timed ones; the namespaces
go and every child is reaped even on failure. A veth is a memory copy in the kernel: only ratios mean much."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from llm_datadist import BlocksCacheKey, CacheDesc, CacheKey, DataType
from llm_datadist._puller.remote import MAX_DESCRIPTORS
from llm_datadist._shm.reaper import reap
from llm_datadist._tools.netns import NamespacePair, hosts_unavailable, in_netns, sigterm_as_exit
from llm_datadist._wire.auth import ENV_SECRET
from llm_datadist.ext import tensor_views

from . import peers
from .ours import OWNER, PREFIX, U64_MAX, Owner, fill_value, link, measurer
from .proc import BlockPattern, Child, Results, copy_samples, fmt_nbytes, timed

TENSORS = 32  # 16 layers of K and V
BLOCK_NBYTES = 64 << 10
SMALL_NBYTES = 4 << 10
_WAIT_S = 120.0  # a child's start-up (engines included), and the longest one measuring step may take
_HEADER = struct.Struct("!Q")  # a TCP request: the number of bytes wanted back

# The row kinds and the rows each of ours is compared with (ids `hosts.<group>.<kind>`). "fresh" is the
# small pull as a serving framework makes it: a new req key per request, consumed; Mooncake has no keys, so
# its 4 KiB read stands for both.
KINDS = ("whole", "layers", "blocks", "small", "fresh")
MOONCAKE_KINDS = ("whole", "layers", "blocks", "small")
MOONCAKE_KIND = {"fresh": "small"}
BASELINE_KIND = {"whole": "bulk", "layers": "bulk", "blocks": "bulk", "small": "small", "fresh": "small"}
GROUPS = ("ours", "mooncake", "tcp", "memcpy")


@dataclass(frozen=True)
class Plan:
    """What every kind moves: `nbytes` in TENSORS tensors of `slice_nbytes` (whole, and layer by layer as
    TENSORS // 2 pulls of K and V), the scattered 64 KiB blocks of `pattern` (the same bytes), and one
    4 KiB tensor; `repeats` timed transfers of the large kinds, `small_repeats` of the 4 KiB one."""

    nbytes: int
    pattern: BlockPattern
    repeats: int
    small_repeats: int

    @property
    def slice_nbytes(self) -> int:
        return self.nbytes // TENSORS

    @property
    def pool_nbytes(self) -> int:
        """What one side registers with a raw engine: room for the tensors and for the block pattern."""
        return max(self.nbytes, self.pattern.tensors * self.pattern.tensor_nbytes)

    @classmethod
    def of(cls, nbytes: int, quick: bool) -> Plan:
        table = max(1, nbytes // (TENSORS * BLOCK_NBYTES))
        rng = np.random.default_rng(0)
        pool_blocks = 2 * table
        pattern = BlockPattern(
            BLOCK_NBYTES,
            TENSORS,
            pool_blocks,
            tuple(int(b) for b in rng.permutation(pool_blocks)[:table]),
            tuple(int(b) for b in rng.permutation(pool_blocks)[:table]),
        )
        budget = (64 << 20) if quick else (2 << 30)
        return cls(nbytes, pattern, max(3, min(100, budget // nbytes)), 100 if quick else 1000)


# ====================================================================== ours: the measuring child in B


def _ours_main(pipe: Connection, port: int, owner_ip: str, local_ip: str, timeout_ms: int) -> None:
    """Links to the owner in A, then answers ("whole" | "layers" | "blocks" | "small", plan) with the
    samples of that kind (`_ours_kind`); the parent has the owner allocate and fill what each kind pulls."""
    datadist = None
    try:
        datadist = measurer("v1", timeout_ms)
        link(datadist, port, owner_ip, local_ip)
        pipe.send(("ok", os.getpid()))
        while pipe.poll(3600):
            command, plan = pipe.recv()
            if command == "stop":
                break
            pipe.send(("ok", _ours_kind(datadist.kv_cache_manager, command, plan)))
    except Exception:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc()))
    finally:
        if datadist is not None:
            datadist.finalize()


def _ours_kind(manager: Any, kind: str, plan: Plan) -> list[float]:
    """One pull of `kind` into a fresh cache of this process, checked, then `repeats` timed ones."""
    key = CacheKey(OWNER, U64_MAX, 0, PREFIX)
    pattern = plan.pattern
    src_rows: np.ndarray[Any, Any] = np.zeros(1, dtype=np.int64)
    dst_rows: np.ndarray[Any, Any] = np.zeros(1, dtype=np.int64)
    repeats = plan.repeats
    if kind == "blocks":
        shape = [pattern.pool_blocks, pattern.block_nbytes // 2]
        cache = manager.allocate_blocks_cache(CacheDesc(pattern.tensors, shape, DataType.DT_FLOAT16))
        src_rows, dst_rows = np.asarray(pattern.src_blocks), np.asarray(pattern.dst_blocks)
        pull = functools.partial(
            manager.pull_blocks,
            BlocksCacheKey(OWNER, 0),
            cache,
            list(pattern.src_blocks),
            list(pattern.dst_blocks),
        )
    elif kind == "small":
        shape = [1, SMALL_NBYTES // 2]
        cache = manager.allocate_cache(CacheDesc(1, shape, DataType.DT_FLOAT16))
        pull = functools.partial(manager.pull_cache, key, cache)
        repeats = plan.small_repeats
    elif kind == "fresh":  # the owner bound req ids 0 .. small_repeats to its slots ("requests")
        shape = [1, SMALL_NBYTES // 2]
        cache = manager.allocate_cache(CacheDesc(1, shape, DataType.DT_FLOAT16))
        keys = iter([CacheKey(OWNER, req_id) for req_id in range(plan.small_repeats + 1)])
        pull = functools.partial(_fresh, manager, keys, cache)
        repeats = plan.small_repeats
    else:
        shape = [1, plan.slice_nbytes // 2]
        cache = manager.allocate_cache(CacheDesc(TENSORS, shape, DataType.DT_FLOAT16))
        pull = functools.partial(manager.pull_cache, key, cache)
        if kind == "layers":
            pull = functools.partial(_by_layer, manager, key, cache)

    views = [view.view(np.uint8).reshape(shape[0], -1) for view in tensor_views(cache)]
    for rows in views:
        rows[:] = 0
    pull()  # the one checked, which also maps or registers what the timed ones reuse
    for t, rows in enumerate(views):
        if not (rows[dst_rows] == fill_value(t, src_rows)[:, None]).all():
            raise RuntimeError(f"{kind}: tensor {t} holds other bytes than the owner's")
    views.clear()  # before the memory is handed back
    samples = timed(pull, repeats)
    manager.deallocate_cache(cache)
    return samples


def _fresh(manager: Any, keys: Iterator[Any], cache: Any) -> None:
    """The next request, by a key object of its own (made before the clock starts), consumed."""
    manager.pull_cache(next(keys), cache)


def _by_layer(manager: Any, key: Any, cache: Any) -> None:
    """One layer (its K and V tensors) per pull, as a Decoder that starts on layer 0 early would."""
    for layer in range(TENSORS // 2):
        one = range(layer, layer + 1)
        manager.pull_cache(key, cache, src_layer_range=one, dst_layer_range=one)


def _ours(results: Results, pair: Any, plan: Plan, port: int, env: dict[str, str], timeout_ms: int) -> None:
    owner = Owner("v1", port, timeout_ms, ip=pair.ip_a, netns=pair.ns_a, env=env, quiet=True)
    try:
        reader = in_netns(pair.ns_b, functools.partial(peers.quietly, _ours_main), env)
        measurer = Child(reader, port, pair.ip_a, pair.ip_b, timeout_ms)
        try:
            measurer.reply(_WAIT_S)

            def measure(kind: str) -> list[float]:
                measurer.pipe.send((kind, plan))
                samples: list[float] = measurer.reply(_WAIT_S)
                return samples

            owner.call("alloc", (TENSORS, [1, plan.slice_nbytes // 2]))
            owner.call("fill")
            slices = f"{TENSORS} x {fmt_nbytes(plan.slice_nbytes)}"
            results.add(
                "ours", f"pull_cache whole, {slices}", plan.nbytes, measure("whole"), id="hosts.ours.whole"
            )
            name = f"pull_cache layer by layer, {TENSORS // 2} pulls of K and V"
            results.add("ours", name, plan.nbytes, measure("layers"), id="hosts.ours.layers")
            owner.call("free")
            pattern = plan.pattern
            owner.call("alloc_blocks", (pattern.tensors, [pattern.pool_blocks, pattern.block_nbytes // 2], 0))
            owner.call("fill")
            name = f"pull_blocks {pattern.table} scattered x {fmt_nbytes(pattern.block_nbytes)} x {TENSORS}"
            results.add("ours", name, pattern.nbytes, measure("blocks"), id="hosts.ours.blocks")
            owner.call("free")
            owner.call("alloc", (1, [1, SMALL_NBYTES // 2]))
            owner.call("fill")
            name = f"pull_cache 1 tensor x {fmt_nbytes(SMALL_NBYTES)}"
            results.add("ours", name, SMALL_NBYTES, measure("small"), id="hosts.ours.small")
            owner.call("free")
            owner.call("requests", (1, SMALL_NBYTES, range(plan.small_repeats + 1), True))
            name = f"pull_cache fresh 1 x {fmt_nbytes(SMALL_NBYTES)} by req key, consumed"
            results.add("ours", name, SMALL_NBYTES, measure("fresh"), id="hosts.ours.fresh")
        finally:
            measurer.close()
    finally:
        owner.close()


# ====================================================================== Mooncake TE, two raw engines


def _engine(ip: str, pool: np.ndarray[Any, Any]) -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(ip, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"TransferEngine.initialize on {ip} failed")
    if engine.register_memory(pool.ctypes.data, pool.nbytes) != 0:
        raise RuntimeError("TransferEngine.register_memory failed")
    return engine


def _mooncake_owner(pipe: Connection, ip: str, pool_nbytes: int) -> None:
    peers._quiet()  # glog's informational lines stay out of the report; failures come through the pipe
    try:
        pool = np.empty(pool_nbytes, dtype=np.uint8)
        peers._pool_fill(pool)
        engine = _engine(ip, pool)
        pipe.send(("ok", (f"{ip}:{engine.get_rpc_port()}", pool.ctypes.data)))
        pipe.poll(3600)  # until told to stop (or the bench went away)
    except Exception:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc(limit=3)))
    finally:
        os._exit(0)  # as peers' children: the engine's threads need no orderly goodbye


def _mooncake_reader(pipe: Connection, ip: str, session: str, remote: int, plan: Plan) -> None:
    """Each kind as the runs our pull moves, as a user hands them to Mooncake: one descriptor per tensor
    (whole: one batch; layer by layer: one batch per layer), one per block, one for the 4 KiB."""
    peers._quiet()
    try:
        pool = np.zeros(plan.pool_nbytes, dtype=np.uint8)
        engine = _engine(ip, pool)
        local = pool.ctypes.data
        expected = np.empty(plan.pool_nbytes, dtype=np.uint8)
        peers._pool_fill(expected)

        def read(batches: list[tuple[list[int], list[int], list[int]]]) -> Callable[[], None]:
            def once() -> None:
                for mine, theirs, lengths in batches:
                    code = engine.batch_transfer_sync_read(session, mine, theirs, lengths)
                    if code != 0:
                        raise RuntimeError(
                            f"batch_transfer_sync_read of {len(mine)} descriptors returned {code}"
                        )

            return once

        def batched(
            mine: list[int], theirs: list[int], length: int
        ) -> list[tuple[list[int], list[int], list[int]]]:
            step = MAX_DESCRIPTORS  # our engine's limit too: Mooncake refuses a few thousand in one batch
            return [
                (mine[i : i + step], theirs[i : i + step], [length] * len(mine[i : i + step]))
                for i in range(0, len(mine), step)
            ]

        slice_nbytes = plan.slice_nbytes
        offsets = [t * slice_nbytes for t in range(TENSORS)]
        tensors = ([local + o for o in offsets], [remote + o for o in offsets])
        kinds: dict[str, tuple[Callable[[], None], int, int]] = {
            "whole": (read(batched(*tensors, slice_nbytes)), plan.nbytes, plan.repeats),
            "layers": (
                read(
                    [
                        (tensors[0][i : i + 2], tensors[1][i : i + 2], [slice_nbytes] * 2)
                        for i in range(0, TENSORS, 2)
                    ]
                ),
                plan.nbytes,
                plan.repeats,
            ),
            "small": (read([([local], [remote], [SMALL_NBYTES])]), SMALL_NBYTES, plan.small_repeats),
        }
        measured: dict[str, list[float]] = {}
        for kind, (once, nbytes, repeats) in kinds.items():
            pool[:nbytes] = 0
            once()
            if not np.array_equal(pool[:nbytes], expected[:nbytes]):
                raise RuntimeError(f"Mooncake {kind}: other bytes than the owner's")
            measured[kind] = timed(once, repeats)
        mine, theirs = peers._descs(plan.pattern, local, remote)
        blocks = read(batched(mine, theirs, plan.pattern.block_nbytes))
        measured["blocks"] = peers._checked_blocks(blocks, pool, plan.pattern, plan.repeats)
        pipe.send(("ok", measured))
    except Exception:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc(limit=3)))
    finally:
        os._exit(0)


def _mooncake(results: Results, pair: Any, plan: Plan) -> None:
    owner = Child(in_netns(pair.ns_a, _mooncake_owner), pair.ip_a, plan.pool_nbytes)
    try:
        session, remote = owner.reply(_WAIT_S)
        reader = Child(in_netns(pair.ns_b, _mooncake_reader), pair.ip_b, session, remote, plan)
        try:
            measured: dict[str, list[float]] = reader.reply(_WAIT_S * len(MOONCAKE_KINDS))
        finally:
            reader.close()
    finally:
        owner.close()
    version = peers._version("mooncake")
    slices = f"{TENSORS} x {fmt_nbytes(plan.slice_nbytes)}"
    descriptors = plan.pattern.tensors * plan.pattern.table
    batches = -(-descriptors // MAX_DESCRIPTORS)
    rows = (
        ("whole", f"batch read, 1 batch of {slices}", plan.nbytes),
        (
            "layers",
            f"batch read, {TENSORS // 2} batches of 2 x {fmt_nbytes(plan.slice_nbytes)}",
            plan.nbytes,
        ),
        (
            "blocks",
            f"batch read, {batches} batch{'es' if batches > 1 else ''} of "
            f"{descriptors} x {fmt_nbytes(BLOCK_NBYTES)} in all",
            plan.pattern.nbytes,
        ),
        ("small", f"batch read, 1 x {fmt_nbytes(SMALL_NBYTES)}", SMALL_NBYTES),
    )
    for kind, name, nbytes in rows:
        results.add("mooncake", name, nbytes, measured[kind], id=f"hosts.mooncake.{kind}", version=version)


# ====================================================================== plain TCP


def _tcp_server(pipe: Connection, ip: str, nbytes: int) -> None:
    """Serves one connection: each request (an 8-byte length) is answered with that many bytes."""
    try:
        payload = memoryview(b"\x07" * nbytes)
        with socket.create_server((ip, 0)) as listener:
            listener.settimeout(_WAIT_S)
            pipe.send(("ok", listener.getsockname()[1]))
            conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(_WAIT_S)
            while header := conn.recv(_HEADER.size, socket.MSG_WAITALL):
                (wanted,) = _HEADER.unpack(header)
                conn.sendall(payload[:wanted])
        pipe.poll(_WAIT_S)
    except Exception:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc(limit=3)))


def _tcp_client(pipe: Connection, ip: str, port: int, plan: Plan) -> None:
    """Times `nbytes` asked for and received whole (sendall on one side, recv_into on the other), then
    4 KiB round trips."""
    try:
        buffer = bytearray(plan.nbytes)
        view = memoryview(buffer)
        with socket.create_connection((ip, port), timeout=_WAIT_S) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def fetch(nbytes: int) -> None:
                sock.sendall(_HEADER.pack(nbytes))
                got = 0
                while got < nbytes:
                    count = sock.recv_into(view[got:nbytes], nbytes - got)
                    if not count:
                        raise ConnectionError("the TCP server closed the connection")
                    got += count

            fetch(plan.nbytes)
            if buffer.count(7) != plan.nbytes:
                raise RuntimeError("TCP brought other bytes than the server's")
            bulk = timed(lambda: fetch(plan.nbytes), plan.repeats)
            fetch(SMALL_NBYTES)
            small = timed(lambda: fetch(SMALL_NBYTES), plan.small_repeats)
        pipe.send(("ok", {"bulk": bulk, "small": small}))
    except Exception:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc(limit=3)))


def _tcp(results: Results, pair: Any, plan: Plan) -> None:
    server = Child(in_netns(pair.ns_a, _tcp_server), pair.ip_a, plan.nbytes)
    try:
        port = server.reply(_WAIT_S)
        client = Child(in_netns(pair.ns_b, _tcp_client), pair.ip_a, port, plan)
        try:
            measured = client.reply(_WAIT_S * 2)
        finally:
            client.close()
    finally:
        server.close()
    name = f"socket sendall -> recv_into, {fmt_nbytes(plan.nbytes)} per request"
    results.add("tcp", name, plan.nbytes, measured["bulk"], id="hosts.tcp.bulk")
    name = f"request -> {fmt_nbytes(SMALL_NBYTES)} response, TCP_NODELAY"
    results.add("tcp", name, SMALL_NBYTES, measured["small"], id="hosts.tcp.small")


def _memcpy(results: Results, plan: Plan) -> None:
    name = "numpy.copyto, 2 threads"
    results.add(
        "memcpy", name, plan.nbytes, copy_samples(plan.nbytes, 2, plan.repeats), id="hosts.memcpy.bulk"
    )
    name = "numpy.copyto, 1 thread"
    samples = copy_samples(SMALL_NBYTES, 1, plan.small_repeats)
    results.add("memcpy", name, SMALL_NBYTES, samples, id="hosts.memcpy.small")


# ====================================================================== report


def _with_ratios(results: Results) -> None:
    """Each of our rows gets `x_mooncake`, `x_tcp`, `x_memcpy`: its GB/s over that row's of the same
    bytes (for the 4 KiB pull: the other's p50 over ours)."""
    by_id = {row["id"]: row for row in results.rows if "id" in row}
    for kind in KINDS:
        ours = by_id.get(f"hosts.ours.{kind}")
        if ours is None:
            continue
        for group, other_id in (
            ("mooncake", f"hosts.mooncake.{MOONCAKE_KIND.get(kind, kind)}"),
            ("tcp", f"hosts.tcp.{BASELINE_KIND[kind]}"),
            ("memcpy", f"hosts.memcpy.{BASELINE_KIND[kind]}"),
        ):
            other = by_id.get(other_id)
            if other is not None and other.get("gbps"):
                ours[f"x_{group}"] = ours["gbps"] / other["gbps"]


def _report(results: Results) -> None:
    columns = ("group", "benchmark", "size", "GB/s", "p50 us", "p99 us", "x Mooncake", "x TCP", "x memcpy")
    header = "{:<9} {:<58} {:>9} {:>7} {:>10} {:>10} {:>10} {:>7} {:>8}".format(*columns)
    print(header)
    print("-" * len(header))
    for _, row in sorted(enumerate(results.rows), key=lambda item: (GROUPS.index(item[1]["group"]), item[0])):
        ratios = " ".join(
            f"{row[key]:{width}.2f}" if key in row else " " * width
            for key, width in (("x_mooncake", 10), ("x_tcp", 7), ("x_memcpy", 8))
        )
        line = (
            f"{row['group']:<9} {row['name']:<58} {fmt_nbytes(row['nbytes']):>9} {row['gbps']:7.2f} "
            f"{row['p50_us']:10.1f} {row['p99_us']:10.1f} {ratios}"
        )
        print(line.rstrip())
    version = next((row["version"] for row in results.rows if "version" in row), "?")
    print(f"mooncake: two raw engines of Mooncake Transfer Engine {version} (TCP transport), as ours uses")
    print(NOTE)


NOTE = """\
x Mooncake, x TCP, x memcpy: our row's GB/s (at the p50) over that of the same bytes moved by two raw
Mooncake engines (the same runs, at most 1024 descriptors per batch), by one TCP connection, by memcpy; for
the 4 KiB pull, the other's p50 over ours. Above 1, ours is faster.
Across hosts: two network namespaces joined by a veth pair, not two machines: a veth is a memory copy in
the kernel, not a wire, so only the ratios of one run mean anything."""


def run(args: argparse.Namespace) -> int:
    reason = hosts_unavailable()
    if reason is not None:
        print(f"bench --hosts: {reason}", file=sys.stderr)
        return 2
    results = Results(quiet=args.quiet)
    plan = Plan.of(args.hosts_mib << 20, args.quick)
    port = args.port or 30000 + os.getpid() % 30000
    env = {ENV_SECRET: secrets.token_hex(32)}
    steps: list[tuple[str, Callable[[Any], None]]] = [
        ("memcpy", lambda pair: _memcpy(results, plan)),
        ("plain TCP", lambda pair: _tcp(results, pair, plan)),
        ("Mooncake TE, raw engines", lambda pair: _mooncake(results, pair, plan)),
        ("llm_datadist v1", lambda pair: _ours(results, pair, plan, port, env, args.timeout_ms)),
    ]
    started = time.monotonic()
    try:
        with sigterm_as_exit(), NamespacePair() as pair:
            if not args.quiet:
                print(
                    f"across hosts: namespace {pair.ns_a} at {pair.ip_a} (owners), {pair.ns_b} at "
                    f"{pair.ip_b} (readers), joined by a veth pair",
                    file=sys.stderr,
                )
            for index, (name, step) in enumerate(steps, 1):
                if not args.quiet:
                    print(
                        f"[{index}/{len(steps)}] {name} ({time.monotonic() - started:.0f} s)", file=sys.stderr
                    )
                step(pair)
            hosts = {"link": "veth pair between two network namespaces", "ip_a": pair.ip_a, "ip_b": pair.ip_b}
    except (OSError, RuntimeError, TimeoutError, subprocess.SubprocessError) as exc:
        print(f"bench --hosts failed: {exc}", file=sys.stderr)
        return 1
    finally:
        reap()
    _with_ratios(results)
    _report(results)
    if args.json:
        machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "numpy": np.__version__}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"machine": machine, "hosts": hosts, "rows": results.rows}, indent=2)
        )
        print(f"JSON written to {args.json}")
    return 0
