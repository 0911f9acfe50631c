"""`llm-datadist soak`: a churn soak through the public API only, in real spawned processes.

Rules: four owners (v1 and v2, one of each long-lived, one of each restarted at the same address by SIGKILL
or `finalize()`) allocate, register, free and unregister caches while three pullers pull and verify every
byte; the driver (`driver`, its processes served by `crew`) relays the owners' catalogues, samples every
long-lived process's RSS, fds, threads and /dev/shm mappings every few seconds (`sampler`) and at two
quiescent checkpoints, and this exits 0 only when nothing failed, every figure is back at the end and no
memory grows. With `--hosts` the owners run in one network namespace and the pullers in another (two
"hosts" joined by a veth pair), linked over TCP with a fresh secret, the bytes moved by the transfer engine.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import shutil
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Iterator
from typing import Any

from llm_datadist._runtime import socket_path

from ..netns import Hosts, NamespacePair, hosts_unavailable, sigterm_as_exit
from ..output import library_log_on_stderr
from .driver import Soak
from .report import report
from .spec import IP, PORT_RANGE

DESCRIPTION = (
    "A churn soak through the public API, in real processes: two v1 and two v2 owners (one of each "
    "restarted by SIGKILL or finalize) allocate, register and free caches while three pullers pull and "
    "verify every byte; every few seconds it samples each long-lived process's RSS, descriptors, threads "
    "and /dev/shm mappings, and passes only when nothing failed and every figure is back where it started. "
    "It runs in a private runtime directory (unless LLM_DATADIST_RUNTIME_DIR is set) on ports of its own, "
    "so runs at the same time do not meet; each child's output goes to a log file, named on failure."
)


def _pick_ports(rng: random.Random, count: int, ip: str) -> list[int]:
    """Ports in 26000-26999 whose socket for `ip` is not already in the runtime directory. `rng` is the
    run's own (seeded with the pid, not the soak's seed): two runs with one seed must not pick one port."""
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randint(*PORT_RANGE)
        if port not in ports and not socket_path(ip, port).exists():
            ports.append(port)
    return ports


@contextlib.contextmanager
def _environment() -> Iterator[str]:
    """A private runtime directory (unless the user chose one) and a fixed copy-thread count, for the
    children; the driver's own environment is restored afterwards."""
    saved = {key: os.environ.get(key) for key in ("LLM_DATADIST_RUNTIME_DIR", "LLM_DATADIST_COPY_THREADS")}
    created: str | None = None
    if not saved["LLM_DATADIST_RUNTIME_DIR"]:
        created = tempfile.mkdtemp(prefix="llmdd-soak-")
        os.environ["LLM_DATADIST_RUNTIME_DIR"] = os.path.join(created, "run")
    if not saved["LLM_DATADIST_COPY_THREADS"]:
        # The copy threads start lazily, up to this many: a fixed count makes "threads" comparable.
        os.environ["LLM_DATADIST_COPY_THREADS"] = "2"
    try:
        yield os.environ["LLM_DATADIST_RUNTIME_DIR"]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)


def soak(
    duration_s: float,
    seed: int,
    out: Any = sys.stdout,
    *,
    hosts: bool = False,
    debug_memory_s: float = 0.0,
) -> int:
    """Run the soak; 0 when nothing failed and every figure is flat, 1 otherwise. With `hosts`, the owners
    run in one fresh network namespace and the pullers in another (deleted before this returns)."""
    with contextlib.ExitStack() as stack:
        runtime = stack.enter_context(_environment())
        # SIGTERM ends the run as Ctrl-C does: children killed, namespaces deleted, segments checked.
        stack.enter_context(sigterm_as_exit())
        where: Hosts | None = None
        if hosts:
            where = Hosts.of(stack.enter_context(NamespacePair()))
        ports = _pick_ports(random.Random(f"{seed}:{os.getpid()}"), 4, where.prompt_ip if where else IP)
        log_dir = tempfile.mkdtemp(prefix="llmdd-soak-logs-")
        runner = Soak(duration_s, seed, log_dir, out, where, debug_memory_s)
        runner.log(f"soak: {duration_s:.0f} s of churn, seed {seed}, runtime dir {runtime}, ports {ports}")
        if where is not None:
            runner.log(
                f"across hosts: owners in network namespace {where.prompt_netns} at {where.prompt_ip}, "
                f"pullers in {where.decoder_netns} at {where.decoder_ip}, joined by a veth pair; a fresh "
                "random secret"
            )
        try:
            runner.run(ports)
            runner.teardown()
        except BaseException as exc:
            runner.failure(f"driver: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            raise
        finally:
            runner.kill_all()
            runner.check_segments()
        runner.checks()
        not_flat = report(runner)
    print("", file=out)
    if runner.failures:
        grouped = Counter(runner.failures)
        print(f"FAILURES ({len(runner.failures)}, {len(grouped)} distinct):", file=out)
        for text, count in grouped.items():
            times = f"{count} x " if count > 1 else ""
            print("  " + times + text.replace("\n", "\n    "), file=out)
    if not_flat:
        print(f"NOT FLAT ({len(not_flat)}):", file=out)
        for text in not_flat:
            print("  " + text, file=out)
    if runner.failures or not_flat:
        print(f"output of every process: {log_dir}", file=out)
        print(f"soak: FAIL ({len(runner.failures)} failure(s), {len(not_flat)} figure(s) not flat)", file=out)
        return 1
    if debug_memory_s > 0:
        print(f"output of every process (memory dumps in the long-lived ones'): {log_dir}", file=out)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    print("soak: PASS (no failure, every figure flat)", file=out)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, help="churn this many minutes (default 1)")
    length.add_argument("--seconds", type=float, help="churn this many seconds (for short runs)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (printed; default: random)")
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="owners and pullers on two hosts: two network namespaces made for the run (root, iproute2 "
        "and the multihost extra)",
    )
    parser.add_argument(
        "--debug-memory",
        type=float,
        default=0.0,
        metavar="S",
        help="for finding what grows: the long-lived children dump tracemalloc, gc and malloc figures to "
        "their logs every S seconds (slows them down; docs/soak.md; default 0: never)",
    )


def run(args: argparse.Namespace) -> int:
    with library_log_on_stderr():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.seconds is not None:
        duration_s = float(args.seconds)
    elif args.minutes is not None:
        duration_s = 60.0 * float(args.minutes)
    else:
        duration_s = 60.0
    if not math.isfinite(duration_s) or duration_s <= 0:
        print("soak: the duration must be positive", file=sys.stderr)
        return 2
    if args.hosts and (reason := hosts_unavailable()) is not None:
        print(f"soak --hosts: {reason}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    return soak(duration_s, seed, hosts=args.hosts, debug_memory_s=args.debug_memory)
