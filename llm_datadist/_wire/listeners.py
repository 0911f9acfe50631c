"""The sockets a server listens on (`Listeners`): Unix sockets bound so that a name that exists is always
served, TCP listeners, and the changes other threads ask for, applied by the server thread.

Rules: any thread may add or remove a listener; only the server thread touches the selector (selectors are
not thread-safe), in `apply`. A removed Unix socket's file is unlinked when its listener closes, so the same
address can be listened on again at once.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from .._runtime import TEMP_SOCKET_PREFIX, remove_stale_socket
from .peer import ListenAddr

__all__ = ["Listeners", "bind_tcp", "bind_unix"]


def bind_unix(path: Path) -> socket.socket:
    """A listening socket at `path` (mode 0600). FileExistsError if a live process serves there.

    The socket is bound under a hidden temporary name and linked to `path` only once it listens: a name
    that exists is always served, so another process probing for stale sockets (a bound socket that
    refuses connections looks exactly like a dead one) never removes a live one.
    """
    remove_stale_socket(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    temporary = path.with_name(f"{TEMP_SOCKET_PREFIX}{secrets.token_hex(4)}.sock")
    try:
        listener.bind(os.fspath(temporary))
        try:
            # Before listen(): nobody can connect until the socket is private.
            os.chmod(temporary, 0o600)
            listener.listen(128)
            listener.setblocking(False)
            os.link(temporary, path)  # EEXIST if a live process took the name meanwhile
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
    except FileExistsError as exc:
        listener.close()
        raise FileExistsError(f"another process is already listening on {path}") from exc
    except OSError:
        listener.close()
        raise
    return listener


def bind_tcp(ip: str, port: int) -> socket.socket:
    """A listening TCP socket at `ip:port` (port 0: any free port). OSError when it cannot be bound."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((ip, port))
        listener.listen(128)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener


@dataclass
class _Change:
    add: bool
    addr: ListenAddr
    listener: socket.socket
    done: threading.Event | None = None  # set once a removal is applied


def close_listener(addr: ListenAddr, listener: socket.socket) -> None:
    listener.close()
    if isinstance(addr, Path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(addr)


class Listeners:
    """The listeners of one server, by address, and the selector changes they wait for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: dict[ListenAddr, socket.socket] = {}
        self._changes: list[_Change] = []

    @property
    def addresses(self) -> list[ListenAddr]:
        with self._lock:
            return list(self._listeners)

    @property
    def changed(self) -> bool:
        """Whether `apply` has work (read without the lock: the server thread looks on every turn)."""
        return bool(self._changes)

    def add(self, addr: ListenAddr, listener: socket.socket) -> None:
        """Serve `listener` (at `addr`) from the next turn of the server thread."""
        with self._lock:
            self._listeners[addr] = listener
            self._changes.append(_Change(True, addr, listener))

    def remove(self, addr: ListenAddr) -> tuple[socket.socket, threading.Event] | None:
        """Stop serving `addr`: the listener and the event the server thread sets once it has closed it
        (None if nothing listens there)."""
        done = threading.Event()
        with self._lock:
            listener = self._listeners.pop(addr, None)
            if listener is None:
                return None
            self._changes.append(_Change(False, addr, listener, done))
        return listener, done

    def forget(self, addr: ListenAddr, listener: socket.socket) -> None:
        """The server thread will not apply the removal of `addr` (it is gone or stuck): close it here."""
        with self._lock:
            self._changes = [change for change in self._changes if change.addr != addr]
        close_listener(addr, listener)

    def apply(self, selector: selectors.BaseSelector) -> None:
        """On the server thread: register what was added, close what was removed."""
        with self._lock:
            changes, self._changes = self._changes, []
        for change in changes:
            if change.add:
                selector.register(change.listener, selectors.EVENT_READ, ("listen", change.addr))
                continue
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(change.listener)
            close_listener(change.addr, change.listener)
            if change.done is not None:
                change.done.set()

    def release_waiters(self) -> None:
        """The server thread died: whoever waits for a removal does it itself now."""
        with self._lock:
            waiting = [change.done for change in self._changes if change.done is not None]
        for done in waiting:
            done.set()

    def abandon(self) -> None:
        """In a forked child: close this process's copies of the listening sockets, unlink nothing. No lock:
        the child has one thread, and a lock another thread of the parent held at the fork stays held."""
        self._lock = threading.Lock()
        listeners, self._listeners = self._listeners, {}
        changes, self._changes = self._changes, []
        for listener in list(listeners.values()) + [change.listener for change in changes]:
            listener.close()

    def unlink_names(self) -> None:
        """Unlink the socket files of our listeners, with no lock and no server thread: the last resort of a
        process about to die without its clean-up."""
        for addr in list(self._listeners) + [change.addr for change in list(self._changes)]:
            if isinstance(addr, Path):
                with contextlib.suppress(OSError):
                    os.unlink(addr)

    def close(self) -> None:
        """Close every listener, served or waiting to be, and release whoever waits for a removal."""
        with self._lock:
            listeners, self._listeners = self._listeners, {}
            changes, self._changes = self._changes, []
        for addr, listener in list(listeners.items()) + [(c.addr, c.listener) for c in changes]:
            close_listener(addr, listener)
        for change in changes:
            if change.done is not None:
                change.done.set()
