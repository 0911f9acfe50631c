"""What a frame costs in the sans-IO protocol, with and without the tags of TCP links: a Ping and its Pong
between two Connections (a Unix socket's pair, then a TCP pair after its handshake); the tag of a frame of
about 1 MiB (a check costs the same); that frame encoded and decoded from 256 KiB reads (as the wire
reads), both ways. No socket: CPU per frame. `python -m llm_datadist._bench.frames [--repeat N]`: best of
N runs, in microseconds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from llm_datadist._protocol.connection import Connection, ConnRole
from llm_datadist._protocol.frames import DEFAULT_MAX_FRAME_NBYTES, FrameDecoder, encode_frame
from llm_datadist._protocol.integrity import CLIENT_TO_SERVER, FrameTagger, derive_frame_keys
from llm_datadist._protocol.messages import PROTOCOL_VERSION, Challenge, Hello, Ping, Pong, Welcome

_SECRET = b"a-secret-for-the-frame-benchmark"
_BIG_NBYTES = DEFAULT_MAX_FRAME_NBYTES - 64  # a bin payload that fits one frame with its msgpack header


def _pair(tcp: bool) -> tuple[Connection, Connection]:
    secret = _SECRET if tcp else None
    client = Connection(ConnRole.CLIENT, challenge=tcp, secret=secret)
    server = Connection(ConnRole.SERVER, challenge=tcp, secret=secret)
    messages: list[tuple[object, Connection, Connection]] = []
    if tcp:
        messages.append((Challenge(PROTOCOL_VERSION, b"s" * 32), server, client))
    nonce, proof = (b"c" * 32, b"p" * 32) if tcp else (b"", b"")
    messages.append(
        (Hello(PROTOCOL_VERSION, 1, 2, 2, 1, 1, nonce, proof, "e:1" if tcp else ""), client, server)
    )
    messages.append(
        (Welcome(PROTOCOL_VERSION, 2, 1, 1, 1, "", 0, 0, proof, "e:2" if tcp else ""), server, client)
    )
    for msg, sender, receiver in messages:
        receiver.receive_data(sender.send(msg))  # type: ignore[arg-type]
        assert receiver.next_event() == msg
    return client, server


def _round_trip(tcp: bool) -> Callable[[], None]:
    client, server = _pair(tcp)

    def once() -> None:
        server.receive_data(client.send(Ping(1)))
        server.next_event()
        client.receive_data(server.send(Pong(1)))
        client.next_event()

    return once


_READ_NBYTES = 256 * 1024
_KEYS = derive_frame_keys(_SECRET, b"s" * 32, b"c" * 32)
_BIG = encode_frame([1, bytes(_BIG_NBYTES)])


def _tagger() -> FrameTagger:
    return FrameTagger(_KEYS.client_to_server, CLIENT_TO_SERVER)


def _tag_only() -> Callable[[], None]:
    tagger = _tagger()

    def once() -> None:
        tagger.tag(_BIG)

    return once


def _big_frame(tagged: bool) -> Callable[[], None]:
    blob = bytes(_BIG_NBYTES)
    sender = _tagger()
    decoder = FrameDecoder()
    if tagged:
        decoder.expect_tags(_tagger())
    # The last frame and object are kept until the next call: freed at once, their 1 MiB would go back to
    # the system and come back as fresh pages every call, which then dominates what is measured.
    held: list[object] = []

    def once() -> None:
        frame = encode_frame([1, blob])
        data = frame + sender.tag(frame) if tagged else frame
        for offset in range(0, len(data), _READ_NBYTES):
            decoder.feed(data[offset : offset + _READ_NBYTES])
        held[:] = [data, decoder.next_frame()]

    return once


def _best_us(run: Callable[[], None], calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each case; the best is shown")
    args = parser.parse_args(argv)
    cases = [
        ("Ping + Pong, Unix socket (untagged)", _round_trip(False), 20000),
        ("Ping + Pong, TCP (tagged both ways)", _round_trip(True), 20000),
        # Checking costs the same: the receiver computes the tag too, then compares 16 bytes.
        (f"tag of a {len(_BIG)} B frame", _tag_only(), 200),
        (f"{len(_BIG)} B frame encoded and decoded, untagged", _big_frame(False), 200),
        (f"{len(_BIG)} B frame encoded and decoded, tagged", _big_frame(True), 200),
    ]
    for name, run, calls in cases:
        print(f"{name:<55} {_best_us(run, calls, args.repeat):10.2f} us")


if __name__ == "__main__":
    main()
