"""The shared secret of TCP links and the proofs of the link handshake.

Rules: the secret comes from `LLM_DATADIST_SECRET`, or from the file `LLM_DATADIST_SECRET_FILE` names, which
must be a regular file nobody but its owner can read or write (mode 0600 or 0400); no secret means no TCP.
Each side proves it knows the secret with an HMAC-SHA256 over both nonces and what the handshake names
(cluster ids, incarnations, engine addresses, its role), so a proof cannot be replayed on another
connection or turned around; proofs are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct

ENV_SECRET = "LLM_DATADIST_SECRET"
ENV_SECRET_FILE = "LLM_DATADIST_SECRET_FILE"
MIN_SECRET_NBYTES = 16
NONCE_NBYTES = 32
_CLIENT_LABEL = b"llm_datadist link client v1"
_SERVER_LABEL = b"llm_datadist link server v1"


class SecretError(Exception):
    """The secret is configured but unusable (a file that is missing, readable by others, too short...)."""


def load_secret() -> bytes | None:
    """The configured shared secret; None when neither variable is set. SecretError when one is set but
    the secret cannot be used. `LLM_DATADIST_SECRET_FILE` wins when both are set (a file keeps the secret
    out of the environment, which other processes of the same user can read)."""
    path = os.environ.get(ENV_SECRET_FILE, "")
    if path:
        secret = _read_secret_file(path)
    else:
        text = os.environ.get(ENV_SECRET, "")
        if not text:
            return None
        secret = text.encode()
    if len(secret) < MIN_SECRET_NBYTES:
        raise SecretError(
            f"the shared secret is {len(secret)} bytes; use at least {MIN_SECRET_NBYTES} "
            "(for example: python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return secret


def _read_secret_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SecretError(f"{ENV_SECRET_FILE}={path} cannot be opened: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"{ENV_SECRET_FILE}={path} is not a regular file")
        if info.st_mode & 0o077:
            raise SecretError(
                f"{ENV_SECRET_FILE}={path} has mode {stat.S_IMODE(info.st_mode):04o}: others may read or "
                f"change it; chmod 600 {path}"
            )
        if info.st_uid != os.geteuid():
            raise SecretError(f"{ENV_SECRET_FILE}={path} belongs to uid {info.st_uid}, not to us")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(64 * 1024 + 1)
    finally:
        os.close(fd)
    if len(data) > 64 * 1024:
        raise SecretError(f"{ENV_SECRET_FILE}={path} is over 64 KiB; a secret is a line")
    return data.strip()  # a trailing newline from `echo` is not part of the secret


def new_nonce() -> bytes:
    return os.urandom(NONCE_NBYTES)


def _transcript(
    server_nonce: bytes,
    client_nonce: bytes,
    client: tuple[int, int, str],
    server: tuple[int, int, str],
) -> bytes:
    """Everything both proofs cover, each part length-prefixed so that no two transcripts read alike.
    `client`/`server`: (cluster id, incarnation, engine address); the server's incarnation is 0 in the
    client's proof (the client learns it from the Welcome that proof answers)."""
    parts = [server_nonce, client_nonce, client[2].encode(), server[2].encode()]
    fixed = struct.pack(">QQQQ", client[0], client[1], server[0], server[1])
    return fixed + b"".join(struct.pack(">H", len(part)) + part for part in parts)


def client_proof(
    secret: bytes, server_nonce: bytes, client_nonce: bytes, client: tuple[int, int, str], server_cluster: int
) -> bytes:
    """The Hello's proof: the client knows the secret, for this challenge and this Hello."""
    transcript = _transcript(server_nonce, client_nonce, client, (server_cluster, 0, ""))
    return hmac.new(secret, _CLIENT_LABEL + transcript, hashlib.sha256).digest()


def server_proof(
    secret: bytes,
    server_nonce: bytes,
    client_nonce: bytes,
    client: tuple[int, int, str],
    server: tuple[int, int, str],
) -> bytes:
    """The Welcome's proof: the server knows the secret, for this Hello and this Welcome."""
    transcript = _transcript(server_nonce, client_nonce, client, server)
    return hmac.new(secret, _SERVER_LABEL + transcript, hashlib.sha256).digest()


def proofs_match(expected: bytes, received: bytes) -> bool:
    return hmac.compare_digest(expected, received)
