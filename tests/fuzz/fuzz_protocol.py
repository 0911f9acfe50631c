"""Coverage-guided fuzzing of the wire protocol with atheris: any byte stream fed to a server- or
client-side connection either yields valid messages or raises a ProtocolError; nothing else may escape.

Run by tests/test_fuzz.py for a bounded number of inputs; for longer, by hand:
    python tests/fuzz/fuzz_protocol.py -runs=1000000
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from llm_datadist._protocol.connection import Closed, Connection, ConnRole
    from llm_datadist._protocol.errors import ProtocolError
    from llm_datadist._protocol.frames import encode_frame
    from llm_datadist._protocol.messages import PROTOCOL_VERSION, Hello, Welcome

_HELLO = encode_frame(Hello(PROTOCOL_VERSION, 1, 2, 2, 4242, 1).to_wire())
_WELCOME = encode_frame(Welcome(PROTOCOL_VERSION, 2, 1, 4343, 2).to_wire())


def _feed(conn: Connection, chunks: list[bytes]) -> None:
    for chunk in chunks:
        if not chunk:
            continue
        conn.receive_data(chunk)
        while True:
            event = conn.next_event()
            if event is None or isinstance(event, Closed):
                break
    conn.receive_data(b"")
    while not isinstance(conn.next_event(), Closed | type(None)):
        pass


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    mode = fdp.ConsumeIntInRange(0, 2)
    cut = fdp.ConsumeIntInRange(1, 64)
    payload = fdp.ConsumeBytes(fdp.remaining_bytes())
    chunks = [payload[i : i + cut] for i in range(0, len(payload), cut)]
    try:
        if mode == 0:  # a server facing arbitrary bytes from the start
            _feed(Connection(ConnRole.SERVER), chunks)
        elif mode == 1:  # a server after a valid handshake
            server = Connection(ConnRole.SERVER)
            server.receive_data(_HELLO)
            server.next_event()
            server.send(Welcome(PROTOCOL_VERSION, 2, 1, 4343, 2))
            _feed(server, chunks)
        else:  # a client after a valid handshake
            client = Connection(ConnRole.CLIENT)
            client.send(Hello(PROTOCOL_VERSION, 1, 2, 2, 4242, 1))
            client.receive_data(_WELCOME)
            client.next_event()
            _feed(client, chunks)
    except ProtocolError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
