"""The `llm-datadist` command: `demo`, `bench`, `soak`, `gc` (remove what dead processes left), `ls`.

Rules: every subcommand exits 0 on success and non-zero with a message on stderr otherwise.
"""

from __future__ import annotations

import argparse
import sys

from llm_datadist import _bench
from llm_datadist._runtime import list_sockets, remove_stale_sockets, runtime_dir
from llm_datadist._shm.reaper import list_segments, reap

from .demo import run as demo
from .netns import remove_stale_namespaces
from .soak import run as soak


def _gc(args: argparse.Namespace) -> int:
    removed = reap()
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} segment(s) of dead processes removed")
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
    segments = list_segments()
    print(f"{'segment':<64} {'pid':>8} {'owner':>6} {'bytes':>14}")
    for info in segments:
        state = "alive" if info.alive else "dead"
        print(f"{info.name:<64} {info.owner.pid:>8} {state:>6} {info.nbytes:>14}")
    print(f"{len(segments)} segment(s)")
    sockets = list_sockets()
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
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser("demo", help="pull real-sized KV cache between two processes and verify it")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.run)
    bench_parser = sub.add_parser("bench", help="measure transfers against memcpy and the alternatives")
    _bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=_bench.run)
    soak_parser = sub.add_parser(
        "soak",
        help="owners restart, pools grow and shrink, pullers verify every byte; figures must stay flat",
    )
    soak.add_arguments(soak_parser)
    soak_parser.set_defaults(func=soak.run)
    sub.add_parser("gc", help="unlink shared memory and sockets left by dead processes").set_defaults(
        func=_gc
    )
    sub.add_parser("ls", help="list this user's llm_datadist shared memory and sockets").set_defaults(
        func=_ls
    )
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
