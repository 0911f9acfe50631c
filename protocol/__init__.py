"""Sans-IO wire protocol between Prompt and Decoder processes: frames, messages, connection state machine.

Imports the standard library and msgpack only (no sockets, threads, numpy or shared memory), so all of it
is testable with plain bytes. `llm_datadist/` owns the sockets and feeds bytes through `Connection`.
"""

from protocol.connection import SENDABLE, Closed, Connection, ConnPhase, ConnRole, ConnState
from protocol.errors import (
    FrameTooLarge,
    LocalProtocolError,
    MalformedFrame,
    ProtocolError,
    RemoteProtocolError,
)
from protocol.frames import DEFAULT_MAX_FRAME_NBYTES, HEADER_NBYTES, FrameDecoder, encode_frame
from protocol.messages import (
    KEY_CACHE_ID,
    KEY_PREFIX,
    KEY_REQ,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    Bye,
    Error,
    Hello,
    Message,
    Ping,
    Pong,
    PullDone,
    PullGrant,
    PullRequest,
    Welcome,
    decode_message,
    encode_message,
)

__all__ = [
    "DEFAULT_MAX_FRAME_NBYTES",
    "HEADER_NBYTES",
    "KEY_CACHE_ID",
    "KEY_PREFIX",
    "KEY_REQ",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "SENDABLE",
    "Ack",
    "Bye",
    "Closed",
    "ConnPhase",
    "ConnRole",
    "ConnState",
    "Connection",
    "Error",
    "FrameDecoder",
    "FrameTooLarge",
    "Hello",
    "LocalProtocolError",
    "MalformedFrame",
    "Message",
    "Ping",
    "Pong",
    "ProtocolError",
    "PullDone",
    "PullGrant",
    "PullRequest",
    "RemoteProtocolError",
    "Welcome",
    "decode_message",
    "encode_frame",
    "encode_message",
]
