"""Cross-memory attach: one-copy reads from and writes into a same-host peer's memory (process_vm_readv).

Owns the ctypes bindings (glibc's process_vm_readv, process_vm_writev, prctl), the errno -> `VmError` mapping
and the checks that say whether the kernel allows attach here. Rules: addresses are raw integers, each in
its own process; runs become iovec arrays filled by numpy (no Python loop per batch entry); at most IOV_MAX
iovecs per call; a short transfer continues where it stopped. No sockets, threads, `protocol` or `shm`.
"""

# Measured on the development machine (Linux 6.18 x86_64, 2 cores, Python 3.11, numpy 2.x), by
# tests/llm_datadist/test_vm.py::test_measure_bandwidth (best of 5, the test process reading a spawned child;
# three runs):
#   read_from, one 64 MiB run:         4.5-5.3 GB/s
#   read_from, 64 runs of 1 MiB:       4.3-5.4 GB/s
#   np.copyto, 64 MiB in one process:  5.2-5.7 GB/s
# So a cross-process read costs about what an in-process copy does. Many tiny runs are bound by the kernel's
# per-iovec page pinning: 50,000 runs of 64 bytes take ~29 ms with read_from_arrays, ~44 ms with read_from
# (the extra is reading 50,000 VmRun objects), not counting the caller building them.

from __future__ import annotations

import ctypes
import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from errno import EACCES, EFAULT, EINTR, EINVAL, ENOSYS, EPERM, ESRCH, errorcode
from os import getpid, strerror
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "FEW_RUNS",
    "IOV_MAX",
    "PreparedRuns",
    "VmBadAddress",
    "VmError",
    "VmNotPermitted",
    "VmProcessGone",
    "VmRun",
    "allow_peers_to_attach",
    "cross_memory_supported",
    "probe",
    "ptrace_scope",
    "read_from",
    "read_from_arrays",
    "write_to",
    "write_to_arrays",
]

IOV_MAX: Final = 1024
"""Most iovecs one process_vm_readv/writev call accepts (the kernel's UIO_MAXIOV; more is EINVAL)."""

_ADDR_LIMIT: Final = 1 << 64
_NBYTES_LIMIT: Final = 1 << 63  # the kernel reads iov_len as ssize_t: a "negative" length is EINVAL
_YAMA_PTRACE_SCOPE: Final = Path("/proc/sys/kernel/yama/ptrace_scope")
_PR_GET_DUMPABLE: Final = 3
_PR_SET_PTRACER: Final = 0x59616D61  # "Yama"
_PR_SET_PTRACER_ANY: Final = ctypes.c_ulong(-1).value
_CAP_SYS_PTRACE: Final = 19


# --- errors ---------------------------------------------------------------------------------------------


class VmError(Exception):
    """A cross-memory call failed; `errno` is the kernel's error number."""

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(message)
        self.errno = errno

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.errno, str(self)))


class VmNotPermitted(VmError):
    """EPERM/EACCES: the kernel refuses cross-memory access to that process (another uid, no
    CAP_SYS_PTRACE, a non-dumpable target, Yama's ptrace_scope, or a seccomp filter)."""


class VmProcessGone(VmError):
    """ESRCH: no such process."""


class VmBadAddress(VmError):
    """EFAULT: a range is not mapped (or not writable, for the destination) in one of the two processes."""


def _errno_name(errno: int) -> str:
    return f"{errorcode.get(errno, f'errno {errno}')} ({strerror(errno)})"


def _error(errno: int, call: str, pid: int, where: str) -> VmError:
    head = f"{call} with pid {pid} failed: {_errno_name(errno)}"
    if errno in (EPERM, EACCES):
        return VmNotPermitted(
            errno,
            f"{head}: the kernel refuses cross-memory access to pid {pid} (it needs the same uid and a "
            "dumpable target, or CAP_SYS_PTRACE; Yama's ptrace_scope may also forbid it, see "
            "allow_peers_to_attach)",
        )
    if errno == ESRCH:
        return VmProcessGone(errno, f"{head}: no process {pid}")
    if errno == EFAULT:
        return VmBadAddress(errno, f"{head}: a range is not mapped in this process or in pid {pid}; {where}")
    if errno == ENOSYS:
        return VmError(errno, f"{head}: this kernel has no cross-memory attach")
    return VmError(errno, f"{head} ({where})")


# --- the copy runs --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VmRun:
    """One contiguous copy of `nbytes` between `local_addr` in this process and `remote_addr` in the peer.
    ValueError for a negative value, an address past 2**64 or nbytes past 2**63 - 1."""

    local_addr: int
    remote_addr: int
    nbytes: int

    def __post_init__(self) -> None:
        if not (
            0 <= self.local_addr < _ADDR_LIMIT
            and 0 <= self.remote_addr < _ADDR_LIMIT
            and 0 <= self.nbytes < _NBYTES_LIMIT
        ):
            raise ValueError(
                f"VmRun needs addresses in [0, 2**64) and nbytes in [0, 2**63), got local_addr="
                f"{self.local_addr:#x}, remote_addr={self.remote_addr:#x}, nbytes={self.nbytes}"
            )


class _Iovec(ctypes.Structure):
    _fields_ = (("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t))


# The same layout as a numpy dtype, so whole iovec arrays are filled by column assignment and then handed
# to ctypes with `from_buffer` (no copy).
_IOV_DTYPE: Final = np.dtype(
    {
        "names": ["base", "len"],
        "formats": [np.uintp, np.uintp],
        "offsets": [_Iovec.iov_base.offset, _Iovec.iov_len.offset],
        "itemsize": ctypes.sizeof(_Iovec),
    }
)
_IOV_SIZE: Final = ctypes.sizeof(_Iovec)
assert np.dtype(np.uintp).itemsize == ctypes.sizeof(ctypes.c_void_p) == ctypes.sizeof(ctypes.c_size_t)

_U64 = npt.NDArray[np.uint64]


def _column(name: str, values: npt.ArrayLike, limit: int) -> _U64:
    """`values` as a 1-D uint64 array; ValueError for a negative value or one at or past `limit`."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if array.dtype.kind not in "iuO":
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    try:
        if array.dtype.kind == "i" and int(array.min()) < 0:
            raise OverflowError
        column = array.astype(np.uint64) if array.dtype.kind != "O" else np.fromiter(array, np.uint64)
    except OverflowError:
        raise ValueError(f"{name} must be in [0, {limit:#x}), got a negative or too large value") from None
    if int(column.max()) >= limit:
        raise ValueError(f"{name} must be in [0, {limit:#x}), got {int(column.max()):#x}")
    return column


_LOCAL = operator.attrgetter("local_addr")
_REMOTE = operator.attrgetter("remote_addr")
_NBYTES = operator.attrgetter("nbytes")


def _columns(runs: Sequence[VmRun]) -> tuple[_U64, _U64, _U64]:
    count = len(runs)
    return (
        np.fromiter(map(_LOCAL, runs), dtype=np.uint64, count=count),
        np.fromiter(map(_REMOTE, runs), dtype=np.uint64, count=count),
        np.fromiter(map(_NBYTES, runs), dtype=np.uint64, count=count),
    )


# --- the system calls -----------------------------------------------------------------------------------

_libc: Final = ctypes.CDLL(None, use_errno=True)


def _bind(name: str) -> Any:
    """The libc function `name` with process_vm_readv's signature, or None when this libc lacks it."""
    function = getattr(_libc, name, None)
    if function is None:
        return None
    iov_p = ctypes.POINTER(_Iovec)
    # ssize_t f(pid_t, const struct iovec *local, unsigned long, const struct iovec *remote, unsigned long,
    #           unsigned long flags)
    function.argtypes = (ctypes.c_int, iov_p, ctypes.c_ulong, iov_p, ctypes.c_ulong, ctypes.c_ulong)
    function.restype = ctypes.c_ssize_t
    return function


_process_vm_readv: Final = _bind("process_vm_readv")
_process_vm_writev: Final = _bind("process_vm_writev")

_prctl: Final = _libc.prctl
_prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_prctl.restype = ctypes.c_int


def _transfer(call: str, function: Any, pid: int, local: _U64, remote: _U64, nbytes: _U64) -> None:
    """Moves every (local, remote, nbytes) run with `function`, IOV_MAX iovecs per call, continuing a
    short transfer at the byte where it stopped. The three columns are already validated."""
    if function is None:
        raise _error(ENOSYS, call, pid, "the C library has no such function")
    pid = operator.index(pid)
    if pid <= 0:
        raise ValueError(f"pid must be positive, got {pid}")
    run_index = np.flatnonzero(nbytes)  # zero-length runs are skipped; messages still name the caller's
    count = int(run_index.size)
    if count == 0:
        return
    local_iov = np.empty(count, dtype=_IOV_DTYPE)
    remote_iov = np.empty(count, dtype=_IOV_DTYPE)
    if count == len(nbytes):
        local_iov["base"], remote_iov["base"] = local, remote
        local_iov["len"] = remote_iov["len"] = nbytes
    else:
        local_iov["base"], remote_iov["base"] = local[run_index], remote[run_index]
        local_iov["len"] = remote_iov["len"] = nbytes[run_index]

    def where(i: int) -> str:
        return (
            f"stopped at run {int(run_index[i])} (local {int(local_iov['base'][i]):#x}, remote "
            f"{int(remote_iov['base'][i]):#x}, {int(local_iov['len'][i])} bytes not moved) or a later run "
            "of the same call"
        )

    start = 0
    while start < count:
        stop = min(start + IOV_MAX, count)
        batch = stop - start
        lengths = local_iov["len"][start:stop]
        wanted = int(lengths.sum())
        iov_type = _Iovec * batch
        done = int(
            function(
                pid,
                iov_type.from_buffer(local_iov.data, start * _IOV_SIZE),
                batch,
                iov_type.from_buffer(remote_iov.data, start * _IOV_SIZE),
                batch,
                0,
            )
        )
        if done < 0:
            errno = ctypes.get_errno()
            if errno == EINTR:
                continue
            raise _error(errno, call, pid, where(start))
        if done == wanted:
            start = stop
            continue
        if done == 0:
            raise VmBadAddress(
                EFAULT, f"{call} with pid {pid} moved no byte although bytes were left; {where(start)}"
            )
        # A short transfer: the kernel stops at the first page it cannot reach (or at MAX_RW_COUNT, about
        # 2 GiB per call). Skip the iovecs it finished and trim the one it stopped inside.
        ends = np.cumsum(lengths, dtype=np.uint64)
        finished = int(np.searchsorted(ends, done, side="right"))
        start += finished
        moved = np.uint64(done - (int(ends[finished - 1]) if finished else 0))
        local_iov["base"][start] += moved
        remote_iov["base"][start] += moved
        local_iov["len"][start] -= moved
        remote_iov["len"][start] -= moved


# Up to this many runs go straight into ctypes iovec arrays: for one 64 KiB block, building numpy columns
# costs several times the system call itself.
FEW_RUNS: Final = 8


def _few_iovecs(function: Any, pid: int, runs: Sequence[VmRun]) -> tuple[Any, Any, int] | None:
    """The (local, remote) ctypes iovec arrays and byte count of a handful of runs (already validated by
    VmRun), or None when the general path must take them (no such function, too few or too many runs,
    a bad pid, nothing to move)."""
    count = len(runs)
    if function is None or not 0 < count <= FEW_RUNS or type(pid) is not int or pid <= 0:
        return None
    local = (_Iovec * count)()
    remote = (_Iovec * count)()
    wanted = 0
    for i, run in enumerate(runs):
        local[i].iov_base = run.local_addr
        local[i].iov_len = run.nbytes
        remote[i].iov_base = run.remote_addr
        remote[i].iov_len = run.nbytes
        wanted += run.nbytes
    return (local, remote, wanted) if wanted > 0 else None


def _few(function: Any, pid: int, runs: Sequence[VmRun]) -> bool:
    """One call for a handful of runs; True when every byte moved. Anything else (an error, EINTR, a short
    transfer, a bad pid) returns False for the general path to redo and explain: moving the same bytes
    again is harmless."""
    iovecs = _few_iovecs(function, pid, runs)
    if iovecs is None:
        return False
    local, remote, wanted = iovecs
    return int(function(pid, local, len(runs), remote, len(runs), 0)) == wanted


def _unchecked(name: str) -> Any:
    """A second binding of `name` without argtypes, for `PreparedRuns`: it takes ready ctypes objects, which
    spares the argument conversion (about a third of a small read's time in ctypes). None when absent."""
    if getattr(_libc, name, None) is None:
        return None
    function = _libc[name]  # a new function object: `_bind`'s keeps its argtypes
    function.restype = ctypes.c_ssize_t
    return function


_UNCHECKED: Final = {
    "process_vm_readv": _unchecked("process_vm_readv"),
    "process_vm_writev": _unchecked("process_vm_writev"),
}


class PreparedRuns:
    """`read_from(pid, runs)` (or `write_to` with `write`) for the same runs again and again: the ctypes
    iovec arrays of a few runs and the call's arguments are built once, so a call is the system call
    alone. As in `read_from`, anything but a complete transfer is redone and explained by the general
    path (moving the same bytes again is harmless)."""

    __slots__ = ("_args", "_call", "_function", "_iovecs", "_pid", "_runs", "_unchecked", "_wanted")

    def __init__(self, pid: int, runs: Sequence[VmRun], *, write: bool = False) -> None:
        self._pid = pid
        self._runs = tuple(runs)
        self._call = "process_vm_writev" if write else "process_vm_readv"
        self._function = _process_vm_writev if write else _process_vm_readv
        self._unchecked = _UNCHECKED[self._call]
        self._iovecs = _few_iovecs(self._function, pid, self._runs)
        self._args: tuple[Any, ...] = ()
        self._wanted = -1
        if self._iovecs is not None and self._unchecked is not None:
            local, remote, self._wanted = self._iovecs
            count = ctypes.c_ulong(len(self._runs))
            # ssize_t f(pid_t, const struct iovec *, unsigned long, const struct iovec *, unsigned long,
            #           unsigned long flags), as `_bind` declares it; byref keeps the arrays alive.
            self._args = (
                ctypes.c_int(pid),
                ctypes.byref(local),
                count,
                ctypes.byref(remote),
                count,
                ctypes.c_ulong(0),
            )

    def __call__(self) -> None:
        if not self._args or self._unchecked(*self._args) != self._wanted:
            _transfer(self._call, self._function, self._pid, *_columns(self._runs))

    @property
    def read_iovecs(self) -> tuple[Any, Any, int] | None:
        """A read's (local, remote) struct iovec arrays and the bytes they move, for a caller that makes the
        system call itself (`oneside`'s checked read); None for a write or where they were not built."""
        if self._call != "process_vm_readv" or not self._args or self._iovecs is None:
            return None
        return self._iovecs


def read_from(pid: int, runs: Sequence[VmRun]) -> None:
    """Copies each run's `nbytes` from `remote_addr` in process `pid` to `local_addr` here: one memory
    copy by the kernel (process_vm_readv), IOV_MAX runs per call. Runs of 0 bytes are skipped; no runs is
    a no-op. Raises VmNotPermitted, VmProcessGone, VmBadAddress (bytes before the bad range have moved)
    or VmError."""
    if not _few(_process_vm_readv, pid, runs):
        _transfer("process_vm_readv", _process_vm_readv, pid, *_columns(runs))


def write_to(pid: int, runs: Sequence[VmRun]) -> None:
    """Copies each run's `nbytes` from `local_addr` here to `remote_addr` in process `pid`
    (process_vm_writev); otherwise as `read_from`."""
    if not _few(_process_vm_writev, pid, runs):
        _transfer("process_vm_writev", _process_vm_writev, pid, *_columns(runs))


def read_from_arrays(
    pid: int, local_addrs: npt.ArrayLike, remote_addrs: npt.ArrayLike, nbytes: npt.ArrayLike
) -> None:
    """`read_from` for runs given as three equal-length integer arrays (run i is local_addrs[i],
    remote_addrs[i], nbytes[i]): for copy plans built with numpy, without a Python object per run."""
    _transfer("process_vm_readv", _process_vm_readv, pid, *_array_columns(local_addrs, remote_addrs, nbytes))


def write_to_arrays(
    pid: int, local_addrs: npt.ArrayLike, remote_addrs: npt.ArrayLike, nbytes: npt.ArrayLike
) -> None:
    """`write_to` for runs given as three equal-length integer arrays, as in `read_from_arrays`."""
    _transfer(
        "process_vm_writev", _process_vm_writev, pid, *_array_columns(local_addrs, remote_addrs, nbytes)
    )


def _array_columns(
    local_addrs: npt.ArrayLike, remote_addrs: npt.ArrayLike, nbytes: npt.ArrayLike
) -> tuple[_U64, _U64, _U64]:
    columns = (
        _column("local_addrs", local_addrs, _ADDR_LIMIT),
        _column("remote_addrs", remote_addrs, _ADDR_LIMIT),
        _column("nbytes", nbytes, _NBYTES_LIMIT),
    )
    if not len(columns[0]) == len(columns[1]) == len(columns[2]):
        raise ValueError(
            f"local_addrs, remote_addrs and nbytes differ in length: {[len(c) for c in columns]}"
        )
    return columns


def probe(pid: int, remote_addr: int) -> None:
    """Reads the byte at `remote_addr` of process `pid` into a private buffer, to learn at link or
    register time (not at the first transfer) whether the kernel lets this process reach that memory.
    Raises VmNotPermitted, VmProcessGone, VmBadAddress or VmError."""
    scratch = ctypes.create_string_buffer(1)
    _transfer(
        "process_vm_readv",
        _process_vm_readv,
        pid,
        np.array([ctypes.addressof(scratch)], dtype=np.uint64),
        _column("remote_addr", [remote_addr], _ADDR_LIMIT),
        np.ones(1, dtype=np.uint64),
    )


# --- may a peer attach? ---------------------------------------------------------------------------------


def ptrace_scope() -> int | None:
    """The value of kernel.yama.ptrace_scope (0 classic, 1 restricted to descendants and declared
    ptracers, 2 admin only, 3 no attach), or None when the kernel has no Yama LSM."""
    try:
        return int(_YAMA_PTRACE_SCOPE.read_text().strip())
    except FileNotFoundError:
        return None


def allow_peers_to_attach() -> bool:
    """Lets every process of this uid read and write this process's memory although Yama's
    ptrace_scope 1 would only let our ancestors do so: prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY).

    Security: afterwards ANY process that passes the classic ptrace checks (same uid, or CAP_SYS_PTRACE)
    may ptrace this process, i.e. read and change its memory and registers, not only our peers. The
    project's threat model is that processes of the same uid are trusted (see the README). The setting
    belongs to this process and is not inherited by children; calling it again changes nothing.

    Returns True when the kernel accepted the call or the kernel has no Yama (nothing to lift), False
    when it refused. True does not promise that attach works (ptrace_scope 2 or 3, another uid, a
    non-dumpable process): `cross_memory_supported` answers that.
    """
    if _prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) == 0:
        return True
    # Without Yama the kernel does not know the option (EINVAL): same-uid attach is allowed anyway.
    return ctypes.get_errno() == EINVAL and ptrace_scope() is None


def _has_cap_sys_ptrace() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _self_probe_failure() -> str | None:
    """Why process_vm_readv fails on this process's own memory (ENOSYS, a seccomp filter), or None."""
    source = np.frombuffer(b"cross-memory", dtype=np.uint8)
    target = np.zeros_like(source)
    try:
        read_from(getpid(), [VmRun(target.ctypes.data, source.ctypes.data, source.nbytes)])
    except VmError as error:
        if error.errno == ENOSYS:
            return "process_vm_readv is not available (ENOSYS)"
        if error.errno in (EPERM, EACCES):
            return (
                f"process_vm_readv is refused even on this process's own memory ({_errno_name(error.errno)}; "
                "a seccomp filter?)"
            )
        return f"process_vm_readv fails on this process's own memory: {error}"
    if not np.array_equal(source, target):
        return "process_vm_readv reported success on this process's own memory but copied wrong bytes"
    return None


@functools.cache
def cross_memory_supported() -> str | None:
    """None when cross-memory attach should work between two processes of the same uid on this host,
    else a reason for a human. Determined once: a real process_vm_readv on this process's own memory
    (catches ENOSYS and seccomp), then Yama's ptrace_scope (1 counts as supported because every process
    whose memory peers touch calls `allow_peers_to_attach`; 2 only with CAP_SYS_PTRACE; 3 never), then
    this process's dumpable flag (a non-dumpable process can only be reached with CAP_SYS_PTRACE). Peers
    are assumed to run with the same capabilities as this process."""
    failure = _self_probe_failure()
    if failure is not None:
        return failure
    scope = ptrace_scope()
    privileged = _has_cap_sys_ptrace()
    if scope == 2 and not privileged:
        return "kernel.yama.ptrace_scope is 2 (attach needs CAP_SYS_PTRACE, which this process lacks)"
    if scope == 3:
        return "kernel.yama.ptrace_scope is 3 (no attach)"
    if scope is not None and scope not in (0, 1, 2):
        return f"kernel.yama.ptrace_scope is {scope}, a value this library does not know"
    if _prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) != 1 and not privileged:
        return "this process is not dumpable (PR_GET_DUMPABLE), so same-uid peers may not attach to it"
    return None
