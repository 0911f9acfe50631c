"""The private runtime directory where listening sides put their Unix sockets.

Rules: the directory is created with mode 0700 and must be owned by us (a directory someone else owns, or
a symlink, is refused: another user could otherwise plant or read sockets). `LLM_DATADIST_RUNTIME_DIR`
overrides the default `$XDG_RUNTIME_DIR/llm_datadist`, falling back to `/tmp/llm_datadist-<uid>`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from .status import LLMStatusCode, make_error

ENV_RUNTIME_DIR = "LLM_DATADIST_RUNTIME_DIR"
# Said wherever a name another program of this user holds is refused (a listen address, a comm's rank).
SHARED_NAMES_HINT = (
    "listen addresses and comm names are this user's, host-wide; give jobs that run side by side a "
    f"runtime directory each ({ENV_RUNTIME_DIR}=<a directory of their own>)"
)
# A listener is bound under a hidden name starting so and linked to its real name once it listens.
TEMP_SOCKET_PREFIX = ".bind-"
# sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_SOCKET_PATH_NBYTES = 107


class RuntimeDirError(Exception):
    """The runtime directory is missing, unsafe or unusable (the message says how to choose another)."""


_CHOOSE_ANOTHER = f"set {ENV_RUNTIME_DIR} (or XDG_RUNTIME_DIR) to a directory of your own"


def runtime_dir() -> Path:
    """The configured runtime directory (not created)."""
    configured = os.environ.get(ENV_RUNTIME_DIR)
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "llm_datadist"
    return Path(f"/tmp/llm_datadist-{os.getuid()}")


def ensure_runtime_dir() -> Path:
    """Create the runtime directory (mode 0700) if needed and check that it is ours and private."""
    path = runtime_dir()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeDirError(f"cannot create runtime directory {path}: {exc}; {_CHOOSE_ANOTHER}") from exc
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"runtime directory {path} is not a plain directory; {_CHOOSE_ANOTHER}")
    if info.st_uid != os.getuid():
        raise RuntimeDirError(
            f"runtime directory {path} belongs to uid {info.st_uid}, not to us (another user may have "
            f"created it first, to intercept our sockets): refused; {_CHOOSE_ANOTHER}"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        # mkdir's mode is filtered by the umask and an existing directory keeps its own: set it explicitly.
        os.chmod(path, 0o700)
    return path


def socket_path(ip: str, port: int) -> Path:
    """Where the side listening on `ip:port` serves: one socket per address, inside the runtime dir."""
    return socket_path_in_runtime(f"{ip}_{port}.sock")


def is_local_ip(ip: str) -> bool:
    """Whether `ip` is this host's (loopback, the wildcard, or an address of one of its interfaces, in this
    network namespace): a peer there is reached through the Unix socket derived from its address, any
    other over TCP."""
    if ip.startswith("127.") or ip == "0.0.0.0":
        return True
    return any(
        address.family == socket.AF_INET and address.address == ip
        for addresses in psutil.net_if_addrs().values()
        for address in addresses
    )


def socket_path_in_runtime(name: str) -> Path:
    """The path of socket file `name` in the runtime directory, checked against the sun_path limit."""
    path = runtime_dir() / name
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH_NBYTES:
        raise RuntimeDirError(
            f"socket path {path} is longer than {_MAX_SOCKET_PATH_NBYTES} bytes; "
            f"set {ENV_RUNTIME_DIR} to a shorter directory"
        )
    return path


def parse_listen_ip_info(value: str, *, api: str = "init") -> tuple[str, int]:
    """Split `"ip:port"` (the `llm.listenIpInfo` option) into a dotted ip and a port, as the real v2
    `parse_listen_ip_info`: not exactly two ':'-separated parts is LLMException(LLM_PARAM_INVALID), a port
    `int()` cannot read is its ValueError. Ours also needs a 16-bit port and an ip `inet_aton` reads (both
    LLM_PARAM_INVALID; the socket path is derived from them); the ip comes back as a dotted quad."""
    parts = value.strip().split(":")
    if len(parts) != 2:
        raise make_error(
            api,
            LLMStatusCode.LLM_PARAM_INVALID,
            f'llm.listenIpInfo "{value}" is invalid, format should be "ip:port"',
        )
    ip, port_text = parts
    port = int(port_text)  # ValueError for a non-numeric port, as in the real helper
    if not 0 <= port <= 0xFFFF:
        raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"port {port} out of range in {value!r}")
    try:
        packed = socket.inet_aton(ip)
    except (OSError, ValueError):
        raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"invalid ip {ip!r} in {value!r}") from None
    return socket.inet_ntoa(packed), port


def remove_stale_socket(path: Path) -> None:
    """Unlink `path` if it is a socket nobody listens on any more (its owner died without cleaning up).

    Raises FileExistsError when a live process still serves there.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise FileExistsError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(os.fspath(path))
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        raise
    finally:
        probe.close()
    raise FileExistsError(f"another process is already listening on {path}")


@dataclass(frozen=True)
class SocketInfo:
    """A socket file in the runtime directory and who serves it (None: nobody, a dead process's leftover)."""

    path: Path
    pid: int | None


def list_sockets() -> list[SocketInfo]:
    """Every socket in the runtime directory with the pid serving it, asked of the kernel (SO_PEERCRED of
    a connection that is closed before saying anything)."""
    directory = runtime_dir()
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob("*.sock")):
        if path.name.startswith("."):
            continue  # a listener being set up (see TEMP_SOCKET_PREFIX)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(os.fspath(path))
            pid, _, _ = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            found.append(SocketInfo(path, pid))
        except OSError:
            found.append(SocketInfo(path, None))
        finally:
            probe.close()
    return found


def remove_stale_sockets() -> list[Path]:
    """Unlink the sockets nobody serves any more (left by processes that died); returns them."""
    removed = []
    for info in list_sockets():
        if info.pid is None:
            with contextlib.suppress(FileNotFoundError, FileExistsError, OSError):
                remove_stale_socket(info.path)
                removed.append(info.path)
    # A temporary name lives for microseconds; one a minute old was left by a process that died then.
    directory = runtime_dir()
    if directory.is_dir():
        for path in directory.glob(f"{TEMP_SOCKET_PREFIX}*.sock"):
            with contextlib.suppress(OSError):
                if time.time() - os.lstat(path).st_mtime > 60:
                    os.unlink(path)
                    removed.append(path)
    return removed
