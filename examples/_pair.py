"""Runs an example's two sides as two processes, joined by a pipe that stands in for the messages a
serving framework sends between its Prompt and Decoder instances (request ids, addresses, "done").

`run_pair(prompt, decoder)` starts both, waits for both, and exits non-zero if either failed (the other one
is stopped then, so nothing waits forever).
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

Side = Callable[[Connection], None]


def run_pair(prompt: Side, decoder: Side, timeout_s: float = 120.0) -> None:
    ctx = mp.get_context("spawn")
    prompt_end, decoder_end = ctx.Pipe()
    sides = [
        ctx.Process(target=prompt, args=(prompt_end,), name="Prompt"),
        ctx.Process(target=decoder, args=(decoder_end,), name="Decoder"),
    ]
    for side in sides:
        side.start()
    running = list(sides)
    while running:
        if not wait([side.sentinel for side in running], timeout_s):
            break
        for side in [side for side in running if not side.is_alive()]:
            running.remove(side)
            if side.exitcode != 0:
                running = []  # one side failed: stop the other rather than let it wait
    for side in sides:
        if side.is_alive():
            side.kill()
        side.join(10)
    failed = [f"{side.name} (exit code {side.exitcode})" for side in sides if side.exitcode != 0]
    if failed:
        sys.exit("failed: " + ", ".join(failed))
    print("both sides finished")
