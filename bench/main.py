"""`llm-datadist bench`'s command line: its options, and which bench runs (`suite`, or `hosts` with
`--hosts`). Rules: the suite and the cross-host bench share plumbing (`proc`, `ours`), never each other.
"""

from __future__ import annotations

import argparse

from . import hosts, suite


def run(args: argparse.Namespace) -> int:
    return hosts.run(args) if args.hosts else suite.run(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes and fewer repetitions (about 10 s)"
    )
    parser.add_argument("--json", default="", help="also write the results as JSON to this file")
    parser.add_argument("--plot", default="", help="also draw a PNG bar chart (needs the 'plot' extra)")
    parser.add_argument(
        "--port",
        type=int,
        default=0,
        help="v1 owner's listen port; v2's and the serving group's two are the next three (default: four "
        "free ones, from the pid)",
    )
    parser.add_argument(
        "--timeout-ms", type=int, default=60000, help="sync_kv_timeout of both sides (default 60000)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="only the bench across hosts: two network namespaces joined by a veth pair, our pulls beside "
        "Mooncake's own reads, plain TCP and memcpy (needs root, iproute2 and Mooncake Transfer Engine)",
    )
    parser.add_argument(
        "--hosts-mib",
        type=_even_mib,
        default=64,
        help="--hosts: MiB of each large pull, in 32 tensors (even, default 64)",
    )


def _even_mib(text: str) -> int:
    value = int(text)
    if value < 2 or value % 2:
        raise argparse.ArgumentTypeError(f"{text}: an even number of MiB, at least 2")
    return value
