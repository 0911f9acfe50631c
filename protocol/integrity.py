"""Frame tags of TCP links after the handshake: per-connection, per-direction keys and HMAC-SHA256 tags.

Keys come from the shared secret and both handshake nonces (HKDF-SHA256, one label per direction). Each
frame is followed by a tag over (direction, the frame's number in that direction, the frame's bytes), so
a frame altered, injected, replayed, reordered or following a dropped one fails. Tags do not encrypt.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from .errors import FrameTagMismatch

__all__ = [
    "CLIENT_TO_SERVER",
    "SERVER_TO_CLIENT",
    "TAG_NBYTES",
    "FrameKeys",
    "FrameTagger",
    "derive_frame_keys",
]

TAG_NBYTES = 16  # HMAC-SHA256 cut to 128 bits, as IPsec's HMAC-SHA-256-128 does
CLIENT_TO_SERVER = b"client->server"
SERVER_TO_CLIENT = b"server->client"
_LABEL = b"llm_datadist frame tags v1 "
_COUNTER = struct.Struct(">Q")
_U64_LIMIT = 1 << 64


def _hkdf_sha256(secret: bytes, salt: bytes, info: bytes) -> bytes:
    """RFC 5869 HKDF with SHA-256, one block (32 bytes) of output."""
    prk = hmac.digest(salt, secret, "sha256")
    return hmac.digest(prk, info + b"\x01", "sha256")


@dataclass(frozen=True)
class FrameKeys:
    """The two keys of one connection."""

    client_to_server: bytes
    server_to_client: bytes

    def taggers(self, *, client: bool) -> tuple[FrameTagger, FrameTagger]:
        """(the tagger of what this side sends, the checker of what it receives)."""
        c2s = FrameTagger(self.client_to_server, CLIENT_TO_SERVER)
        s2c = FrameTagger(self.server_to_client, SERVER_TO_CLIENT)
        return (c2s, s2c) if client else (s2c, c2s)


def derive_frame_keys(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> FrameKeys:
    """The keys of the connection whose Challenge carried `server_nonce` and whose Hello `client_nonce`.
    The nonces are length-prefixed in the salt, so no two pairs of nonces make the same one."""
    salt = b"".join(struct.pack(">H", len(nonce)) + nonce for nonce in (server_nonce, client_nonce))
    return FrameKeys(
        _hkdf_sha256(secret, salt, _LABEL + CLIENT_TO_SERVER),
        _hkdf_sha256(secret, salt, _LABEL + SERVER_TO_CLIENT),
    )


class FrameTagger:
    """The tags of one direction of one connection: `tag` gives the next frame's, `check` checks the next
    frame received. Each frame's number is its position in that direction since tags began (0, 1, ...)."""

    __slots__ = ("_direction", "_frames", "_keyed")

    def __init__(self, key: bytes, direction: bytes) -> None:
        if direction not in (CLIENT_TO_SERVER, SERVER_TO_CLIENT):
            raise ValueError(f"direction must be CLIENT_TO_SERVER or SERVER_TO_CLIENT, got {direction!r}")
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)  # the key's pads, hashed once
        self._direction = direction
        self._frames = 0

    @property
    def frames(self) -> int:
        """Frames tagged (or checked) so far."""
        return self._frames

    def _next(self, frame: bytes | bytearray | memoryview) -> bytes:
        if self._frames >= _U64_LIMIT:  # 2**64 frames: never, but a wrapped counter would allow replays
            raise FrameTagMismatch("frame counter exhausted: the connection must end")
        mac = self._keyed.copy()
        mac.update(self._direction + _COUNTER.pack(self._frames))
        mac.update(frame)
        return mac.digest()[:TAG_NBYTES]

    def tag(self, frame: bytes | bytearray | memoryview) -> bytes:
        """The tag to send after `frame` (header and payload)."""
        tag = self._next(frame)
        self._frames += 1
        return tag

    def check(self, frame: bytes | bytearray | memoryview, tag: bytes) -> None:
        """FrameTagMismatch unless `tag` is the one the next frame of this direction must carry."""
        if not hmac.compare_digest(self._next(frame), tag):
            number = self._frames
            raise FrameTagMismatch(
                f"frame {number} {self._direction.decode()} does not carry its tag: it was altered, "
                "injected, replayed or reordered, or one before it was lost"
            )
        self._frames += 1
