"""Who may link to this server (`Door`): the checks of a Hello, the Welcome a peer gets, the Challenge and
the proofs of a TCP peer, which unproven TCP connection makes room for a newcomer, and how refusals are
logged.

Rules: decisions and replies only: a refusal is queued on the connection, which ends (the server writes it
and closes). A peer on this host
is known by its socket's credentials (same uid, the pid it claims); a peer on another host proves it knows
the shared secret before anything else it says is looked at, and we prove it back in the Welcome.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence

from llm_datadist._protocol.errors import ProtocolError
from llm_datadist._protocol.frames import DEFAULT_MAX_FRAME_NBYTES
from llm_datadist._protocol.messages import PROTOCOL_VERSION, Challenge, Error, Hello, Welcome

from .._errors import StatusError
from ..status import LLMStatusCode
from ..utils.log import log
from . import auth
from .admission import AdmissionLimits, Refusal, RefusalLog, make_room
from .conn import ServerConn
from .peer import PeerInfo, Service

__all__ = ["HANDSHAKE_TIMEOUT_S", "Door", "Refused"]

# A peer on this host has this long to say Hello; a TCP peer has `AdmissionLimits.proof_timeout_s`.
HANDSHAKE_TIMEOUT_S = 10.0


# Why a link was refused, as the instance's stats count it (`Door.on_refused`).
REFUSAL_CAUSES = ("secret", "version", "uid", "cluster", "closing", "admission", "other")


class Refused(Exception):
    """A handshake this side turns down: the peer gets LLM_LINK_FAILED with `reason`, then the socket
    closes."""

    def __init__(self, reason: str, kind: Refusal = Refusal.HANDSHAKE, cause: str = "other") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
        self.cause = cause  # what the stats count it as: one of REFUSAL_CAUSES


class Door:
    """The handshake side of one server: cluster id, role and incarnation it answers with, the secret TCP
    peers prove, and the admission limits of those that have not proved it yet."""

    def __init__(
        self,
        *,
        cluster_id: int,
        role: int,
        incarnation: int,
        secret: bytes | None,
        admission: AdmissionLimits | None,
    ) -> None:
        self.cluster_id = cluster_id
        self.role = role
        self.incarnation = incarnation
        self.secret = secret  # TCP links prove they know it; None: no TCP listener is allowed
        self.admission = admission or AdmissionLimits()
        # Anyone who reaches a TCP port can be refused as often as it likes: one line per address and 10 s.
        self._refusals = RefusalLog(functools.partial(log.warning, "server %d: %s", cluster_id))
        self.closing = False  # finalizing: no new handshakes
        # Told the cause (`REFUSAL_CAUSES`) of every refusal: the instance's stats.
        self.on_refused: Callable[[str], None] | None = None

    def challenge(self, sconn: ServerConn) -> Challenge:
        """The first frame a TCP peer gets: a fresh nonce its proof must cover."""
        sconn.nonce = auth.new_nonce()
        return Challenge(PROTOCOL_VERSION, sconn.nonce)

    def welcome(self, sconn: ServerConn, hello: Hello, service: Service) -> Welcome:
        """Admit the peer that sent `hello` (sets `sconn.peer`) and return its Welcome; Refused if not."""
        if sconn.host:
            return self._welcome_tcp(sconn, hello, service)
        reason, cause = "", "other"
        if hello.version != PROTOCOL_VERSION:
            reason, cause = f"protocol version {hello.version} is not {PROTOCOL_VERSION}", "version"
        elif sconn.uid != os.getuid():
            reason, cause = f"peer uid {sconn.uid} is not ours", "uid"
        elif hello.remote_cluster_id != self.cluster_id:
            reason = f"this side is cluster {self.cluster_id}, not {hello.remote_cluster_id}"
            cause = "cluster"
        elif hello.pid != sconn.pid:
            reason = f"hello claims pid {hello.pid}, socket says {sconn.pid}"
        elif hello.nonce or hello.proof or hello.engine:
            reason = "a peer on this host sends no proof and no engine"
        elif self.closing:
            reason, cause = "this side is finalizing", "closing"
        if reason:
            raise Refused(reason, cause=cause)
        sconn.peer = PeerInfo(hello.cluster_id, hello.role, hello.pid, hello.incarnation)
        # A row of the published index to pin through; with none free the peer asks us instead.
        index, row, ticket = service.admit(sconn, sconn.peer)
        return Welcome(
            PROTOCOL_VERSION, self.cluster_id, self.role, os.getpid(), self.incarnation, index, row, ticket
        )

    def _welcome_tcp(self, sconn: ServerConn, hello: Hello, service: Service) -> Welcome:
        """A peer on another host: it gets no row of our index (it cannot map it), it asks us."""
        secret = self.secret
        client = (hello.cluster_id, hello.incarnation, hello.engine)
        if secret is None or not hello.nonce or not hello.proof:
            raise Refused("no proof of the shared secret", cause="secret")
        expected = auth.client_proof(secret, sconn.nonce, hello.nonce, client, hello.remote_cluster_id)
        if not auth.proofs_match(expected, hello.proof):
            raise Refused("wrong shared secret", cause="secret")
        if hello.version != PROTOCOL_VERSION:
            raise Refused(f"protocol version {hello.version} is not {PROTOCOL_VERSION}", cause="version")
        if hello.remote_cluster_id != self.cluster_id:
            raise Refused(
                f"this side is cluster {self.cluster_id}, not {hello.remote_cluster_id}", cause="cluster"
            )
        if not hello.engine:
            raise Refused("the peer runs no transfer engine")
        if self.closing:
            raise Refused("this side is finalizing", cause="closing")
        try:
            engine = service.serve_remote(str(sconn.sock.getsockname()[0]))
        except StatusError as exc:
            raise Refused(exc.detail) from exc
        sconn.conn.raise_frame_limit(DEFAULT_MAX_FRAME_NBYTES)
        sconn.pid = hello.pid  # what it claims: a pid on another host, for the log only
        sconn.peer = PeerInfo(
            hello.cluster_id, hello.role, hello.pid, hello.incarnation, host=sconn.host, engine=hello.engine
        )
        server = (self.cluster_id, self.incarnation, engine)
        proof = auth.server_proof(secret, sconn.nonce, hello.nonce, client, server)
        log.info(
            "server %d: cluster %d linked from %s (engine %s)",
            self.cluster_id,
            hello.cluster_id,
            sconn.host,
            hello.engine,
        )
        return Welcome(
            PROTOCOL_VERSION,
            self.cluster_id,
            self.role,
            os.getpid(),
            self.incarnation,
            "",
            0,
            0,
            proof,
            engine,
        )

    def overdue(self, sconn: ServerConn, selected_at: float) -> str:
        """Why a connection that has not linked yet must go at `selected_at` ("" while it has time)."""
        age_s = selected_at - sconn.accepted_at
        if sconn.host and age_s > self.admission.proof_timeout_s:
            return f"no proof of the shared secret within {self.admission.proof_timeout_s:g} s"
        if not sconn.host and age_s > HANDSHAKE_TIMEOUT_S:
            return "no handshake within the time limit"
        return ""

    def make_room(self, unproven: Sequence[ServerConn], source: str) -> tuple[ServerConn, Refused] | None:
        """Before a TCP connection from `source` is admitted: the unproven connection it replaces, if any,
        and why (`admission.make_room`), so a newcomer is never turned away for what other addresses hold.
        `unproven`: oldest first."""
        victim = make_room([(c.host, c) for c in unproven], source, self.admission)
        if victim is None:
            return None
        limits = self.admission
        reason = (
            f"closed to make room for a newer connection ({limits.per_source} per address and "
            f"{limits.total} in all may be proving the shared secret at once)"
        )
        return victim, Refused(reason, Refusal.MADE_ROOM, cause="admission")

    def refuse(self, sconn: ServerConn, refused: Refused) -> None:
        """LLM_LINK_FAILED with the reason, then the connection ends. Logged at once for a peer on this
        host; through the refusal log (a line per address and interval) for one on TCP, since anyone who
        reaches the port can be refused as often as it likes."""
        self._count(refused.cause)
        if sconn.host:
            self._refusals.refused(sconn.host, refused.reason, refused.kind, time.monotonic())
        else:
            pid, reason = sconn.pid, refused.reason
            log.warning("server %d: refusing link from pid %d: %s", self.cluster_id, pid, reason)
        sconn.send(Error(0, int(LLMStatusCode.LLM_LINK_FAILED), refused.reason))
        sconn.end(refused.reason)

    def refused_full(self, host: str, reason: str) -> None:
        """A TCP connection closed at accept: the server holds all it may."""
        self._count("admission")
        self._refusals.refused(host, reason, Refusal.FULL, time.monotonic())

    def _count(self, cause: str) -> None:
        if self.on_refused is not None:
            try:
                self.on_refused(cause)
            except Exception:  # counting never stops a refusal
                log.exception("server %d: counting a refusal failed", self.cluster_id)

    def log_protocol_error(self, sconn: ServerConn, exc: ProtocolError) -> None:
        if sconn.host and sconn.peer is None:  # anyone who reaches the port: through the refusal log
            self._refusals.refused(sconn.host, f"protocol error: {exc}", Refusal.PROTOCOL, time.monotonic())
        else:
            log.warning("server %d: closing connection from pid %d: %s", self.cluster_id, sconn.pid, exc)

    def flush_log(self, now: float) -> None:
        self._refusals.flush(now)
