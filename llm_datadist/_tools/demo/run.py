"""`llm-datadist demo`'s parent: starts the v1 pair, then the v2 pair (each side a spawned process, in
a network namespace of its own with `--hosts`), prints each row as it comes and the table at the end.

Rules: the parent only orchestrates over pipes, prints and reaps; every wait is bounded, and a side that
ended or reported an error ends the wait at once. Exit 0 only when every byte was verified.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from llm_datadist._shm.reaper import reap

from ..netns import Hosts, NamespacePair, hosts_unavailable, in_netns, sigterm_as_exit
from . import v1, v2
from .common import Shape

Watched = tuple[tuple[mp.process.BaseProcess, Connection], ...]


def _wait(pipe: Connection, what: str, timeout_s: float, watched: Watched = ()) -> Any:
    """The next result from a child, printing its progress rows as they come. Every wait is bounded, and
    a watched process (with the pipe it reports on) that ended, a crash or an error it reported, ends the
    wait at once rather than at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{what} did not answer within {timeout_s:.0f} s")
        if not pipe.poll(min(remaining, 0.5)):
            for process, other in watched:
                if process.exitcode is None or pipe.poll(0):
                    continue
                if other is not pipe and other.poll(0):
                    status, value = other.recv()
                    if status == "error":
                        raise RuntimeError(f"{process.name} failed:\n{value}")
                raise RuntimeError(f"{what}: the {process.name} process ended (exit code {process.exitcode})")
            continue
        status, value = pipe.recv()
        if status == "progress":
            seconds = value.get("seconds")
            took = f" in {seconds * 1e3:.1f} ms" if seconds is not None else ""
            print(f"  done: {value['name']}, {_format_nbytes(value['nbytes'])}{took}", flush=True)
            continue
        if status == "error":
            raise RuntimeError(f"{what} failed:\n{value}")
        return value


def _format_nbytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def print_table(rows: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    reference = next((r["gbps"] for r in rows if r["name"] == "numpy.copyto, 2 threads"), None)
    header = f"{'transfer':<48} {'bytes':>10} {'time ms':>9} {'GB/s':>7} {'x memcpy(2T)':>13}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for row in rows:
        seconds = row.get("seconds")
        time_text = f"{seconds * 1e3:9.2f}" if seconds is not None else f"{'':>9}"
        ratio = f"{row['gbps'] / reference:13.2f}" if reference else f"{'':>13}"
        print(
            f"{row['name']:<48} {_format_nbytes(row['nbytes']):>10} {time_text} {row['gbps']:7.2f} {ratio}",
            file=out,
        )


RATIO_NOTE = """
x memcpy(2T): each row's rate divided by the 2-thread numpy.copyto row of this same run, which moves the
same bytes between two private buffers. Near 1 means the pull costs about what copying the bytes costs.
Absolute GB/s vary from run to run (often by 30% or more on a shared or virtual machine: other load,
frequency scaling, where the pages landed), so compare rows of one run; the ratios move much less.
A full run with NIXL and Mooncake beside us: `llm-datadist bench` (figures in bench/README.md)."""


def _run_pair(
    prompt_target: Any,
    decoder_target: Any,
    shape: Shape,
    port: int,
    timeout_ms: int,
    *,
    together: bool,
    hosts: Hosts | None = None,
) -> dict[str, Any] | None:
    """Run a Prompt and a Decoder process; `together` starts both at once (a two-sided link needs both).
    With `hosts`, each enters its namespace first thing and the Prompt listens on its namespace's address."""
    ctx = mp.get_context("spawn")
    prompt_pipe, prompt_child = ctx.Pipe()
    decoder_pipe, decoder_child = ctx.Pipe()
    # The Decoder asks the Prompt for the layer-wise push directly, over its own pipe.
    prompt_peer, decoder_peer = ctx.Pipe()
    ips: tuple[str, ...] = ()
    if hosts is not None:
        prompt_target = in_netns(hosts.prompt_netns, prompt_target, hosts.env)
        decoder_target = in_netns(hosts.decoder_netns, decoder_target, hosts.env)
        ips = (hosts.prompt_ip, hosts.decoder_ip)
    prompt = ctx.Process(
        target=prompt_target, args=(prompt_child, prompt_peer, shape, port, timeout_ms, *ips), name="prompt"
    )
    decoder = ctx.Process(
        target=decoder_target,
        args=(decoder_child, decoder_peer, shape, port, timeout_ms, *ips),
        name="decoder",
    )
    result: dict[str, Any] | None = None
    interrupted = False
    try:
        prompt.start()
        if together:
            decoder.start()
        both: Watched = ((prompt, prompt_pipe), (decoder, decoder_pipe))
        _wait(prompt_pipe, "prompt", 600, both if together else both[:1])
        print("  done: Prompt ready", flush=True)
        if not together:
            decoder.start()
        result = _wait(decoder_pipe, "decoder", 1800, both)
        prompt_pipe.send(("stop", None))
        _wait(prompt_pipe, "prompt", 120, both[:1])
    except (TimeoutError, RuntimeError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        result = None
    except BaseException:  # Ctrl-C, or SIGTERM across hosts (`sigterm_as_exit`): no time to wait
        interrupted = True
        raise
    finally:
        for process in (decoder, prompt):
            if process.pid is None:
                continue  # never started (the Prompt failed first)
            process.join(0.5 if interrupted else 30)
            if process.is_alive():
                process.kill()
                process.join(10)
        reap()
    return result


V1_START = "v1 (kv_cache_manager): starting a Prompt that allocates, prefaults and fills the requests..."
HOSTS_NOTE = """\
Across hosts: these rows ran across two network namespaces joined by a veth pair, linked over TCP
with a shared secret, the bytes moved by Mooncake Transfer Engine. A veth is a memory copy in the kernel,
not a wire, so only the ratios mean anything."""
V2_START = "v2 (cache_manager): both sides register numpy memory and link two-sided..."


def _run_hosts(
    shape: Shape, port: int, timeout_ms: int
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The v1 pair, then the v2 pair, with the Prompt in one fresh namespace and the Decoder in another
    (see `netns.Hosts`; the v2 rank table names each side's address); the namespaces are deleted before it
    returns."""
    try:
        with sigterm_as_exit(), NamespacePair() as pair:
            hosts = Hosts.of(pair)
            print(
                f"across hosts: the Prompt in network namespace {pair.ns_a} at {pair.ip_a}:{port}, the "
                f"Decoder in {pair.ns_b} at {pair.ip_b}, joined by a veth pair; a fresh random secret"
            )
            print(V1_START)
            v1_result = _run_pair(v1.prompt, v1.decoder, shape, port, timeout_ms, together=False, hosts=hosts)
            print(V2_START)
            v2_result = _run_pair(v2.prompt, v2.decoder, shape, port, timeout_ms, together=True, hosts=hosts)
            return v1_result, v2_result
    except (OSError, RuntimeError, TimeoutError, subprocess.SubprocessError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return None, None


def run(args: argparse.Namespace) -> int:
    if args.small:
        shape = Shape(layers=4, tokens=256, kv_heads=8, head_dim=128)
    else:
        shape = Shape(layers=args.layers, tokens=args.tokens, kv_heads=args.kv_heads, head_dim=args.head_dim)
    if args.hosts and (reason := hosts_unavailable()) is not None:
        print(f"demo --hosts: {reason}", file=sys.stderr)
        return 2
    port = args.port or 20000 + os.getpid() % 40000
    total = shape.slot_nbytes * shape.num_tensors
    print(
        f"KV cache: {shape.layers} layers x (K, V), {shape.tokens} tokens, {shape.kv_heads} KV heads x "
        f"{shape.head_dim}, fp16: {_format_nbytes(total)} per request, {os.cpu_count()} CPUs"
    )
    if args.hosts:
        v1_result, v2_result = _run_hosts(shape, port, args.timeout_ms)
    else:
        print(V1_START)
        v1_result = _run_pair(v1.prompt, v1.decoder, shape, port, args.timeout_ms, together=False)
        # Cache-manager mode, shaped like vllm-ascend's connector: both sides register memory they own,
        # link two-sided, and the Decoder pulls a block table.
        print(V2_START)
        v2_result = _run_pair(v2.prompt, v2.decoder, shape, port, args.timeout_ms, together=True)
    if v1_result is None or v2_result is None:
        return 1
    print()
    print_table(v1_result["rows"] + v2_result["rows"])
    print(RATIO_NOTE)
    if args.hosts:
        print(HOSTS_NOTE)
    mismatches = v1_result["mismatches"] + v2_result["mismatches"]
    if mismatches:
        print(f"FAILED: {mismatches} bytes differ", file=sys.stderr)
        return 1
    print("every byte verified")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small", action="store_true", help="4 layers x 256 tokens (4 MiB per request)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--port", type=int, default=0, help="Prompt listen port (default: derived from the pid)"
    )
    parser.add_argument("--timeout-ms", type=int, default=60000, help="sync_kv_timeout of both sides")
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="the Prompt and the Decoder in two network namespaces joined by a veth pair, linked over TCP "
        "(needs root, iproute2 and Mooncake Transfer Engine)",
    )
