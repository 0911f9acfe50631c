"""Frame codec: a 4-byte big-endian unsigned payload length, then exactly one msgpack object, then on a
TCP link after its handshake the frame's tag (`integrity.py`), checked before the payload is parsed.

Owns only bytes <-> Python objects; message meaning lives in `messages.py`. Every length is bounded by
max_frame_nbytes before anything is buffered for it, msgpack's limits are tied to the frame size, ext types
and nil payloads are refused. A decoder that raised is dead: later calls raise the same error class."""

from __future__ import annotations

import struct
from typing import NoReturn

import msgpack

from .errors import FrameTagMismatch, FrameTooLarge, MalformedFrame, ProtocolError
from .integrity import TAG_NBYTES, FrameTagger

__all__ = ["DEFAULT_MAX_FRAME_NBYTES", "HEADER_NBYTES", "FrameDecoder", "encode_frame"]

HEADER_NBYTES = 4
DEFAULT_MAX_FRAME_NBYTES = 1 << 20

_HEADER = struct.Struct(">I")
_U32_MAX = (1 << 32) - 1
# Consumed bytes are dropped from the front of the buffer lazily, once they are this many or more than half
# of it, so a chunk carrying many small frames is not memmoved once per frame.
_COMPACT_MIN_NBYTES = 64 * 1024


def _check_max_frame_nbytes(max_frame_nbytes: int) -> None:
    if isinstance(max_frame_nbytes, bool) or not isinstance(max_frame_nbytes, int):
        raise TypeError(f"max_frame_nbytes must be an int, got {type(max_frame_nbytes).__name__}")
    if not 1 <= max_frame_nbytes <= _U32_MAX:
        raise ValueError(f"max_frame_nbytes must be in [1, {_U32_MAX}], got {max_frame_nbytes}")


def encode_frame(
    obj: object, max_frame_nbytes: int = DEFAULT_MAX_FRAME_NBYTES, packer: msgpack.Packer | None = None
) -> bytes:
    """Return header + msgpack payload for obj; FrameTooLarge when the payload exceeds max_frame_nbytes.

    obj is normally `Message.to_wire()`. Objects msgpack cannot pack raise msgpack's TypeError/OverflowError:
    that is a bug in the caller, not a protocol condition. A caller that encodes many frames may pass its
    own `msgpack.Packer(use_bin_type=True)` (not shared between threads) instead of one made per call.
    """
    _check_max_frame_nbytes(max_frame_nbytes)
    payload: bytes = packer.pack(obj) if packer is not None else msgpack.packb(obj, use_bin_type=True)
    if len(payload) > max_frame_nbytes:
        raise FrameTooLarge(f"frame payload is {len(payload)} bytes, limit is {max_frame_nbytes}")
    return _HEADER.pack(len(payload)) + payload


def _refuse_ext(code: int, data: bytes) -> NoReturn:
    raise MalformedFrame(f"msgpack ext type {code} is not allowed")


class FrameDecoder:
    """Incremental decoder: feed() any chunking of a frame stream, then next_frame() until it returns None.

    Bytes after the last complete frame stay buffered (they are the start of the next frame). The header
    is checked as soon as its 4 bytes are buffered, so an oversized frame is refused before its body.
    """

    __slots__ = ("_buffer", "_checker", "_error", "_max_frame_nbytes", "_start", "_tag_nbytes")

    def __init__(self, max_frame_nbytes: int = DEFAULT_MAX_FRAME_NBYTES) -> None:
        _check_max_frame_nbytes(max_frame_nbytes)
        self._max_frame_nbytes = max_frame_nbytes
        self._buffer = bytearray()
        self._start = 0  # offset of the first unconsumed byte in _buffer
        self._error: ProtocolError | None = None
        self._checker: FrameTagger | None = None
        self._tag_nbytes = 0

    def expect_tags(self, checker: FrameTagger) -> None:
        """From the next frame on, each frame is followed by its tag (`TAG_NBYTES`), which `checker` must
        accept before the payload is parsed; a frame without a good tag kills the decoder."""
        self._checker = checker
        self._tag_nbytes = TAG_NBYTES

    @property
    def max_frame_nbytes(self) -> int:
        return self._max_frame_nbytes

    @max_frame_nbytes.setter
    def max_frame_nbytes(self, max_frame_nbytes: int) -> None:
        """Change the limit for frames not yet started (a connection lifts it once its peer proved itself)."""
        _check_max_frame_nbytes(max_frame_nbytes)
        self._max_frame_nbytes = max_frame_nbytes

    @property
    def buffered_nbytes(self) -> int:
        """Bytes fed but not yet returned as part of a frame."""
        return len(self._buffer) - self._start

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._raise_if_dead()
        if self._start and (self._start >= _COMPACT_MIN_NBYTES or 2 * self._start >= len(self._buffer)):
            del self._buffer[: self._start]
            self._start = 0
        self._buffer += data

    def next_frame(self) -> object | None:
        """Return the next decoded payload, or None when no complete frame is buffered yet.

        A payload that is msgpack nil is MalformedFrame, so None is never ambiguous.
        """
        if self._error is not None:
            self._raise_if_dead()
        if len(self._buffer) - self._start < HEADER_NBYTES:
            return None
        (payload_nbytes,) = _HEADER.unpack_from(self._buffer, self._start)
        if payload_nbytes > self._max_frame_nbytes:
            limit = self._max_frame_nbytes
            self._die(FrameTooLarge(f"frame header announces {payload_nbytes} bytes, limit is {limit}"))
        if payload_nbytes == 0:
            self._die(MalformedFrame("frame with an empty payload"))
        body_start = self._start + HEADER_NBYTES
        body_end = body_start + payload_nbytes
        if body_end + self._tag_nbytes > len(self._buffer):
            return None
        payload: bytes | memoryview
        if self._checker is None:
            payload = bytes(self._buffer[body_start:body_end])
            self._start = body_end
        else:
            payload = self._checked_payload(self._checker, body_end)
        try:
            obj: object = msgpack.unpackb(
                payload,
                raw=False,
                use_list=True,
                strict_map_key=True,
                ext_hook=_refuse_ext,
                # A frame of n bytes cannot hold a string, array or map longer than n: anything announcing
                # more is hostile, and refusing it up front stops msgpack from preallocating for it.
                max_str_len=payload_nbytes,
                max_bin_len=payload_nbytes,
                max_array_len=payload_nbytes,
                max_map_len=payload_nbytes,
                max_ext_len=0,
            )
        except MalformedFrame as exc:
            self._die(exc)
        except msgpack.ExtraData as exc:
            self._die(MalformedFrame("frame payload holds more than one msgpack object"), exc)
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
            # Invalid UTF-8, unknown format bytes, nesting too deep, non-string map keys, incomplete object...
            self._die(MalformedFrame(f"frame payload is not valid msgpack: {exc}"), exc)
        if obj is None:
            # None is next_frame's "need more data"; no message is nil, so refusing it costs nothing.
            self._die(MalformedFrame("frame payload is msgpack nil"))
        return obj

    def _checked_payload(self, checker: FrameTagger, body_end: int) -> memoryview:
        """The payload of the frame that ends at `body_end`, once its tag (right after it) checked out."""
        frame = bytes(self._buffer[self._start : body_end])
        tag = bytes(self._buffer[body_end : body_end + TAG_NBYTES])
        self._start = body_end + TAG_NBYTES
        try:
            checker.check(frame, tag)
        except FrameTagMismatch as exc:
            self._die(exc)
        return memoryview(frame)[HEADER_NBYTES:]

    def _die(self, error: ProtocolError, cause: BaseException | None = None) -> NoReturn:
        self._error = error
        raise error from cause

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            # A fresh instance of the same class, so tracebacks do not pile up on the original.
            raise type(self._error)(f"frame decoder failed earlier: {self._error}") from self._error
