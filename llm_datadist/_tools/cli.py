"""The `llm-datadist` command: `demo`, `bench`, `soak`, `stats` (what live instances moved), `exporter`
(the same for Prometheus), `gc` (remove what dead processes left), `ls`.

Rules: every subcommand exits 0 on success and non-zero with a message on stderr otherwise; every option has
a help text; stdout is line-buffered, so each line the tools print goes out whole (`output`).
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from llm_datadist import _bench
from llm_datadist._runtime import list_sockets, remove_stale_sockets, runtime_dir
from llm_datadist._shm.reaper import list_segments, reap

from . import exporter
from . import stats as stats_command
from .demo import run as demo
from .netns import remove_stale_namespaces
from .output import LOG_NOTE, whole_lines
from .soak import run as soak

DISTRIBUTION = "llm-datadist-host"
BENCH_DESCRIPTION = (
    "Measure our transfers (v1 and v2, whole, layer by layer, scattered blocks, small-message latency) "
    "against numpy.copyto, sockets, multiprocessing pipes and queues, and NIXL and Mooncake when they are "
    "installed; print a table of GB/s and p50/p99 times with ratios to memcpy. Progress lines go to stderr "
    "and the report to stdout, one whole line at a time, so the library's log lines (stdout, as the real "
    "library writes them; level from ASCEND_GLOBAL_LOG_LEVEL, ERROR by default) fall between its lines, "
    "never inside one. Its ports are its own (free ones, from the pid): runs at the same time do not meet."
)


def _version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown (the package is not installed)"


def _gc(args: argparse.Namespace) -> int:
    removed = reap(pid=args.pid)
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} segment(s) of dead processes removed")
    if args.pid is not None:
        return 0  # stale sockets and namespaces carry no pid: left for a gc without --pid
    sockets = remove_stale_sockets()
    for path in sockets:
        print(f"removed {path}")
    print(f"{len(sockets)} stale socket(s) removed")
    namespaces = remove_stale_namespaces()
    for name in namespaces:
        print(f"removed network namespace {name}")
    if namespaces:
        print(f"{len(namespaces)} network namespace(s) of dead demo, bench or test runs removed")
    return 0


def _ls(args: argparse.Namespace) -> int:
    segments = [info for info in list_segments() if args.pid is None or info.owner.pid == args.pid]
    print(f"{'segment':<64} {'pid':>8} {'owner':>6} {'bytes':>14}")
    for info in segments:
        state = "alive" if info.alive else "dead"
        print(f"{info.name:<64} {info.owner.pid:>8} {state:>6} {info.nbytes:>14}")
    print(f"{len(segments)} segment(s)")
    sockets = [sock for sock in list_sockets() if args.pid is None or sock.pid == args.pid]
    print(f"\n{'socket (in ' + str(runtime_dir()) + ')':<64} {'pid':>8} {'state':>8}")
    for sock in sockets:
        pid = str(sock.pid) if sock.pid is not None else "-"
        print(f"{sock.path.name:<64} {pid:>8} {'serving' if sock.pid is not None else 'stale':>8}")
    print(f"{len(sockets)} socket(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llm-datadist", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the installed version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    demo_parser = sub.add_parser(
        "demo",
        help="pull real-sized KV cache between two processes and verify it",
        description=demo.DESCRIPTION,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.run)
    bench_parser = sub.add_parser(
        "bench", help="measure transfers against memcpy and the alternatives", description=BENCH_DESCRIPTION
    )
    _bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=_bench.run)
    soak_parser = sub.add_parser(
        "soak",
        help="owners restart, pools grow and shrink, pullers verify every byte; figures must stay flat",
        description=soak.DESCRIPTION + " " + LOG_NOTE,
    )
    soak.add_arguments(soak_parser)
    soak_parser.set_defaults(func=soak.run)
    stats_parser = sub.add_parser(
        "stats",
        help="what every live instance of this user moved, how fast, what failed",
        description=stats_command.DESCRIPTION,
    )
    stats_command.add_arguments(stats_parser)
    stats_parser.set_defaults(func=stats_command.run)
    exporter_parser = sub.add_parser(
        "exporter",
        help="serve every live instance's figures as Prometheus metrics",
        description=exporter.DESCRIPTION,
    )
    exporter.add_arguments(exporter_parser)
    exporter_parser.set_defaults(func=exporter.run)
    gc_parser = sub.add_parser(
        "gc",
        help="unlink shared memory and sockets left by dead processes",
        description="Unlink this user's /dev/shm segments whose owner died, the sockets in the runtime "
        "directory nobody serves, and network namespaces of dead demo, bench or test runs; what live "
        "processes hold is left alone.",
    )
    gc_parser.add_argument(
        "--pid", type=int, help="only the segments that dead process left (sockets carry no pid: not touched)"
    )
    gc_parser.set_defaults(func=_gc)
    ls_parser = sub.add_parser(
        "ls",
        help="list this user's llm_datadist shared memory and sockets",
        description="List this user's /dev/shm segments (owner pid, alive or dead, size) and the sockets "
        "in the runtime directory (who serves each, or stale).",
    )
    ls_parser.add_argument("--pid", type=int, help="only what process PID owns or serves")
    ls_parser.set_defaults(func=_ls)
    args = parser.parse_args(argv)
    whole_lines()
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
