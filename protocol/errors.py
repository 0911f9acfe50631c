"""Errors of the protocol layer, named by condition.

Everything raised by `protocol/` for bad bytes or a bad sequence of messages is a `ProtocolError`;
`llm_datadist/` translates them to `LLMException` in one place. Argument errors made by the calling code
(a negative limit, a non-message passed to `send`) stay the builtin `ValueError`/`TypeError`.
"""

from __future__ import annotations

__all__ = [
    "FrameTagMismatch",
    "FrameTooLarge",
    "LocalProtocolError",
    "MalformedFrame",
    "ProtocolError",
    "RemoteProtocolError",
]


class ProtocolError(Exception):
    """Base of every protocol-layer error."""


class FrameTooLarge(ProtocolError):
    """A frame header announces (or an encoder produced) more payload than max_frame_nbytes allows."""


class FrameTagMismatch(ProtocolError):
    """A frame of a TCP link does not carry the tag its key, direction and position give (see
    `integrity`): someone on the path changed, added, repeated, reordered or removed frames."""


class MalformedFrame(ProtocolError):
    """A frame's payload is not exactly one msgpack object of a known message with valid fields.

    Also raised when constructing a message with an invalid field, so a bad message cannot exist at all.
    """


class LocalProtocolError(ProtocolError):
    """This side tried something the connection state machine forbids; nothing was sent."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something invalid, out of order, or closed the stream in the middle of a frame."""
