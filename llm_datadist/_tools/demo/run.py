"""`llm-datadist demo`'s parent: checks what /dev/shm can hold (`fit`), then starts the v1 pair and, only if
it passed, the v2 pair (each side a spawned process, in a network namespace of its own with `--hosts`),
prints their progress as it comes (`watch`) and the table at the end.

Rules: the parent only orchestrates over pipes, prints and reaps; every wait is bounded, and a side that
ended or reported an error ends the wait at once. The first failure ends the run. The port and the
communicator are this run's own (`names`). Exit 0 only when every byte was verified; 2 when the demo cannot
run here (before anything started), 1 when it failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
from typing import Any

from llm_datadist._shm.reaper import reap
from llm_datadist._shm.space import format_nbytes, shm_space

from ..names import free_ports, run_name
from ..netns import Hosts, NamespacePair, hosts_unavailable, in_netns, sigterm_as_exit
from ..output import LOG_NOTE, library_log_on_stderr, say
from . import fit, v1, v2
from .common import IP, KERNEL_COPY, NUMPY_COPY, Setup, Shape
from .watch import Side, Watch


def print_table(rows: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    copies = [r["gbps"] for r in rows if r["name"] in (NUMPY_COPY, KERNEL_COPY)]
    reference = max(copies, default=None)
    header = f"{'transfer':<48} {'bytes':>10} {'time ms':>9} {'GB/s':>7} {'x best copy':>12}"
    lines = [header, "-" * len(header)]
    for row in rows:
        if "serving" in row:
            continue
        seconds = row.get("seconds")
        time_text = f"{seconds * 1e3:9.2f}" if seconds is not None else f"{'':>9}"
        ratio = f"{row['gbps'] / reference:12.2f}" if reference else f"{'':>12}"
        lines.append(
            f"{row['name']:<48} {format_nbytes(row['nbytes']):>10} {time_text} {row['gbps']:7.2f} {ratio}"
        )
    for line in lines:
        say(line, out)
    serving = [row for row in rows if "serving" in row]
    if not serving:
        return
    say("", out)
    header = (
        f"{'serving: a new key object per request, consumed':<48} {'bytes':>10} {'pulls':>6} {'p50 us':>9} "
        f"{'p99 us':>9} {'CPU us':>8} {'x best copy':>12}"
    )
    say(header, out)
    say("-" * len(header), out)
    for row in serving:
        stats = row["serving"]
        ratio = f"{row['gbps'] / reference:12.2f}" if reference else f"{'':>12}"
        say(
            f"{row['name']:<48} {format_nbytes(row['nbytes']):>10} {stats['pulls']:>6} "
            f"{stats['p50'] * 1e6:9.1f} {stats['p99'] * 1e6:9.1f} {stats['cpu'] * 1e6:8.1f} {ratio}",
            out,
        )


RATIO_NOTE = f"""
x best copy: each row's rate divided by the faster of this run's two 2-thread copies between private
buffers ("{NUMPY_COPY}" and, where the C kernel was built, "{KERNEL_COPY}"
of the same bytes). Near 1 means the pull costs about what copying the bytes costs. The serving rows time
each pull alone (p50, p99 over the pulls; CPU: the Decoder's, all its threads, per pull, p50), their
rate at the p50.
Absolute GB/s vary from run to run (often by 30% or more on a shared or virtual machine: other load,
frequency scaling, where the pages landed), so compare rows of one run; the ratios move much less.
A full run with NIXL and Mooncake beside us: `llm-datadist bench` (figures in bench/README.md)."""


def _run_pair(
    prompt_target: Any,
    decoder_target: Any,
    shape: Shape,
    setup: Setup,
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
    if hosts is not None:
        prompt_target = in_netns(hosts.prompt_netns, prompt_target, hosts.env)
        decoder_target = in_netns(hosts.decoder_netns, decoder_target, hosts.env)
    prompt = Side(
        "prompt",
        ctx.Process(target=prompt_target, args=(prompt_child, prompt_peer, shape, setup), name="prompt"),
        prompt_pipe,
    )
    decoder = Side(
        "decoder",
        ctx.Process(target=decoder_target, args=(decoder_child, decoder_peer, shape, setup), name="decoder"),
        decoder_pipe,
    )
    watch = Watch(prompt, decoder)
    result: dict[str, Any] | None = None
    interrupted = False
    try:
        prompt.process.start()
        if together:
            decoder.process.start()
        both = (prompt, decoder)
        watch.wait(prompt, "prompt", 600, both if together else (prompt,))
        watch.line("  done: Prompt ready")
        if not together:
            decoder.process.start()
        result = watch.wait(decoder, "decoder", 1800, both)
        prompt_pipe.send(("stop", None))
        watch.wait(prompt, "prompt", 120, (prompt,))
    except (TimeoutError, RuntimeError) as exc:
        say(f"demo failed: {exc}", sys.stderr)
        result = None
    except BaseException:  # Ctrl-C, or SIGTERM across hosts (`sigterm_as_exit`): no time to wait
        interrupted = True
        raise
    finally:
        for process in (decoder.process, prompt.process):
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
V1_FAILED = "demo: stopped after the v1 half failed (the v2 half did not run)"


Result = tuple[list[dict[str, Any]], int]  # the rows of both halves, and the bytes that differed


def _halves(shape: Shape, setup: Setup, hosts: Hosts | None) -> Result | None:
    """The v1 pair, then, only if it passed, the v2 pair: their rows and mismatches, or None at the first
    failure."""
    say(V1_START)
    v1_result = _run_pair(v1.prompt, v1.decoder, shape, setup, together=False, hosts=hosts)
    if v1_result is None:
        say(V1_FAILED, sys.stderr)
        return None
    # Cache-manager mode, shaped like vllm-ascend's connector: both sides register memory they own, link
    # two-sided, and the Decoder pulls a block table.
    say(V2_START)
    v2_result = _run_pair(v2.prompt, v2.decoder, shape, setup, together=True, hosts=hosts)
    if v2_result is None:
        return None
    return v1_result["rows"] + v2_result["rows"], v1_result["mismatches"] + v2_result["mismatches"]


def _across_hosts(shape: Shape, setup: Setup) -> Result | None:
    """`_halves` with the Prompt in one fresh namespace and the Decoder in another (see `netns.Hosts`; the
    v2 rank table names each side's address); the namespaces are deleted before it returns."""
    try:
        with sigterm_as_exit(), NamespacePair() as pair:
            hosts = Hosts.of(pair)
            say(
                f"across hosts: the Prompt in network namespace {pair.ns_a} at {pair.ip_a}:{setup.port}, the "
                f"Decoder in {pair.ns_b} at {pair.ip_b}, joined by a veth pair; a fresh random secret"
            )
            placed = Setup(setup.port, setup.comm_name, setup.timeout_ms, hosts.prompt_ip, hosts.decoder_ip)
            return _halves(shape, placed, hosts)
    except (OSError, RuntimeError, TimeoutError, subprocess.SubprocessError) as exc:
        say(f"demo failed: {exc}", sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    with library_log_on_stderr():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    sized = args.small or any(
        value is not None for value in (args.layers, args.tokens, args.kv_heads, args.head_dim)
    )
    if args.small:
        shape = fit.SMALL
    else:
        shape = Shape(
            layers=fit.DEFAULT.layers if args.layers is None else args.layers,
            tokens=fit.DEFAULT.tokens if args.tokens is None else args.tokens,
            kv_heads=fit.DEFAULT.kv_heads if args.kv_heads is None else args.kv_heads,
            head_dim=fit.DEFAULT.head_dim if args.head_dim is None else args.head_dim,
        )
    if args.hosts and (reason := hosts_unavailable()) is not None:
        say(f"demo --hosts: {reason}", sys.stderr)
        return 2
    plan = fit.plan(shape, shm_space(), sized=sized)
    for line in plan.lines:
        say(line)
    if plan.shape is None:
        say(plan.refusal, sys.stderr)
        return 2
    shape = plan.shape
    setup = Setup(args.port or free_ports(IP), run_name(v2.COMM_PREFIX), args.timeout_ms)
    say(f"KV cache: {fit.describe(shape)}, {os.cpu_count()} CPUs")
    say(f"this run's names: port {setup.port}, communicator {setup.comm_name!r}")
    result = _across_hosts(shape, setup) if args.hosts else _halves(shape, setup, None)
    if result is None:
        return 1
    rows, mismatches = result
    say()
    print_table(rows)
    say(RATIO_NOTE)
    if args.hosts:
        say(HOSTS_NOTE)
    if mismatches:
        say(f"FAILED: {mismatches} bytes differ", sys.stderr)
        return 1
    say("every byte verified")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: not a port (1-65535)")
    return value


DESCRIPTION = f"""Spawn a Prompt and a Decoder process and move a request of KV cache every way the API
offers (v1: whole, layer by layer, with offsets, pushed, as a block table; v2: registered memory over a
two-sided link), print a line per step and a table of times next to numpy.copyto, and verify every byte.
It checks /dev/shm first: the default size needs about {format_nbytes(fit.need(fit.DEFAULT).nbytes)} of it;
with less it scales itself down (when you chose the size, it says what to do instead), and it stops at the
first failure. Its port and communicator are its own: runs at the same time do not meet. {LOG_NOTE}"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--small",
        action="store_true",
        help=f"4 layers x 256 tokens: 4 MiB per request, about {format_nbytes(fit.need(fit.SMALL).nbytes)} "
        "of /dev/shm, a few seconds",
    )
    parser.add_argument("--layers", type=_positive, help="model layers, each a K and a V tensor (default 32)")
    parser.add_argument("--tokens", type=_positive, help="tokens per request (default 4096)")
    parser.add_argument("--kv-heads", type=_positive, help="KV heads per tensor (default 8)")
    parser.add_argument("--head-dim", type=_positive, help="elements per head, fp16 (default 128)")
    parser.add_argument(
        "--port", type=_port, default=0, help="the Prompt's listen port (default: a free one, from the pid)"
    )
    parser.add_argument(
        "--timeout-ms", type=_positive, default=60000, help="sync_kv_timeout of both sides (default 60000)"
    )
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="the Prompt and the Decoder in two network namespaces joined by a veth pair, linked over TCP "
        "(needs root, iproute2 and Mooncake Transfer Engine)",
    )
