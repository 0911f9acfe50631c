"""Cross-memory attach (`llm_datadist._puller.vm`) between real processes: a spawned child driven over a Pipe
holds memory with known patterns; the test process reads and writes it with one copy. Also the kernel's
refusals (an unmapped range, a reaped pid, a lower-privileged reader), short transfers that stop inside a
run, and a printed bandwidth measurement (numbers recorded at the top of `llm_datadist/_puller/vm.py`)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import multiprocessing as mp
import os
import select
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llm_datadist._puller.vm import (
    IOV_MAX,
    PreparedRuns,
    VmBadAddress,
    VmError,
    VmNotPermitted,
    VmProcessGone,
    VmRun,
    allow_peers_to_attach,
    cross_memory_supported,
    probe,
    ptrace_scope,
    read_from,
    read_from_arrays,
    write_to,
    write_to_arrays,
)

TIMEOUT_S = 20.0
PAGE = mmap.PAGESIZE
PROT_NONE = 0  # the mmap module does not export it
SIZES = {"a": 3333, "b": 4097, "c": (1 << 20) + 1}

pytestmark = pytest.mark.skipif(
    cross_memory_supported() is not None, reason=f"no cross-memory attach here: {cross_memory_supported()}"
)


def pattern(seed: int, tag: str, nbytes: int) -> np.ndarray:
    return np.random.default_rng([seed, *tag.encode()]).integers(0, 256, nbytes, dtype=np.uint8)


def cheap_pattern(nbytes: int) -> np.ndarray:
    """0, 1, ..., 250, 0, 1, ...: fast to make at 64 MiB, and 251 does not divide a 1 MiB run."""
    return np.resize(np.arange(251, dtype=np.uint8), nbytes)


# --- the child ------------------------------------------------------------------------------------------


def _child_main(conn: Connection) -> None:
    """Holds named arrays and answers commands until told to exit (or left idle too long)."""
    arrays: dict[str, np.ndarray] = {}
    allow_peers_to_attach()
    try:
        while conn.poll(60.0):
            command, *args = conn.recv()
            if command == "alloc":  # name, nbytes, seed -> address of a fresh array holding pattern(...)
                name, nbytes, seed = args
                arrays[name] = pattern(seed, name, nbytes)
                conn.send(arrays[name].ctypes.data)
            elif command == "fill":  # name, nbytes -> address of an array of a cheap, known pattern
                name, nbytes = args
                arrays[name] = cheap_pattern(nbytes)
                conn.send(arrays[name].ctypes.data)
            elif command == "verify":  # name, seed -> whether the array now holds pattern(seed, name)
                name, seed = args
                conn.send(bool(np.array_equal(arrays[name], pattern(seed, name, arrays[name].nbytes))))
            elif command == "dump":
                conn.send(arrays[args[0]].tobytes())
            elif command == "exit":
                conn.send(None)
                return
            else:
                conn.send(f"unknown command {command!r}")
    finally:
        conn.close()


class Child:
    def __init__(self, process: Any, conn: Connection) -> None:
        self.process = process
        self.conn = conn

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None
        return int(pid)

    def call(self, *command: Any) -> Any:
        self.conn.send(command)
        if not self.conn.poll(TIMEOUT_S):
            raise AssertionError(f"child did not answer {command[0]!r} within {TIMEOUT_S} s")
        return self.conn.recv()

    def stop(self) -> None:
        """Asks the child to exit and reaps it; SIGKILL as the last resort."""
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, AssertionError):
                self.call("exit")
        self.process.join(TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(TIMEOUT_S)


@contextlib.contextmanager
def child() -> Iterator[Child]:
    context = mp.get_context("spawn")
    parent_end, child_end = context.Pipe()
    process = context.Process(target=_child_main, args=(child_end,), daemon=True)
    process.start()
    child_end.close()
    handle = Child(process, parent_end)
    try:
        yield handle
    finally:
        handle.stop()
        parent_end.close()


# --- round trips ----------------------------------------------------------------------------------------


def test_read_and_write_odd_sizes(seed: int) -> None:
    with child() as peer:
        remote = {name: peer.call("alloc", name, nbytes, seed) for name, nbytes in SIZES.items()}
        local = {name: np.zeros(nbytes, dtype=np.uint8) for name, nbytes in SIZES.items()}
        read_from(peer.pid, [VmRun(local[name].ctypes.data, remote[name], SIZES[name]) for name in SIZES])
        for name, nbytes in SIZES.items():
            np.testing.assert_array_equal(local[name], pattern(seed, name, nbytes), err_msg=name)

        new_seed = seed + 1
        fresh = {name: pattern(new_seed, name, nbytes) for name, nbytes in SIZES.items()}
        write_to(peer.pid, [VmRun(fresh[name].ctypes.data, remote[name], SIZES[name]) for name in SIZES])
        for name in SIZES:
            assert peer.call("verify", name, new_seed) is True, name


def test_prepared_runs_repeat_a_transfer_and_explain_a_failure(seed: int) -> None:
    """PreparedRuns builds the call once: it moves the same bytes on every call, writes too, and a
    transfer that no longer completes (the range went away) raises what read_from raises."""
    with child() as peer:
        remote = {name: peer.call("alloc", name, nbytes, seed) for name, nbytes in SIZES.items()}
        local = {name: np.zeros(nbytes, dtype=np.uint8) for name, nbytes in SIZES.items()}
        runs = [VmRun(local[name].ctypes.data, remote[name], SIZES[name]) for name in SIZES]
        read = PreparedRuns(peer.pid, runs)
        for _ in range(3):
            for array in local.values():
                array[:] = 0
            read()
            for name, nbytes in SIZES.items():
                np.testing.assert_array_equal(local[name], pattern(seed, name, nbytes), err_msg=name)
        fresh = {name: pattern(seed + 1, name, nbytes) for name, nbytes in SIZES.items()}
        PreparedRuns(
            peer.pid,
            [VmRun(fresh[name].ctypes.data, remote[name], SIZES[name]) for name in SIZES],
            write=True,
        )()
        for name in SIZES:
            assert peer.call("verify", name, seed + 1) is True, name
        bad = PreparedRuns(peer.pid, [VmRun(local["a"].ctypes.data, 4096, 64)])  # nothing mapped there
        with pytest.raises(VmBadAddress):
            bad()


def test_many_small_scattered_runs_against_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nbytes, count, size = 64, 5000, SIZES["c"]
    assert count > 4 * IOV_MAX
    with child() as peer:
        base = peer.call("alloc", "c", size, seed)
        source = pattern(seed, "c", size)

        # Read: arbitrary (possibly overlapping) remote offsets into shuffled local slots.
        offsets = rng.integers(0, size - nbytes + 1, count)
        slots = rng.permutation(count)
        local = np.zeros(count * nbytes, dtype=np.uint8)
        runs = [
            VmRun(local.ctypes.data + int(slot) * nbytes, base + int(offset), nbytes)
            for offset, slot in zip(offsets, slots, strict=True)
        ]
        read_from(peer.pid, runs)
        expected = np.zeros_like(local)
        expected.reshape(count, nbytes)[slots] = source[offsets[:, None] + np.arange(nbytes)]
        np.testing.assert_array_equal(local, expected)

        # The array form moves the same bytes.
        again = np.zeros_like(local)
        read_from_arrays(peer.pid, again.ctypes.data + slots * nbytes, base + offsets, np.full(count, nbytes))
        np.testing.assert_array_equal(again, expected)

        # Write: distinct, unaligned remote targets (one byte past a 64-byte boundary), from a fresh buffer.
        targets = rng.choice((size - 1) // nbytes, count, replace=False) * nbytes + 1
        data = rng.integers(0, 256, count * nbytes, dtype=np.uint8)
        write_to(
            peer.pid,
            [VmRun(data.ctypes.data + i * nbytes, base + int(t), nbytes) for i, t in enumerate(targets)],
        )
        reference = source.copy()
        reference[targets[:, None] + np.arange(nbytes)] = data.reshape(count, nbytes)
        np.testing.assert_array_equal(np.frombuffer(peer.call("dump", "c"), dtype=np.uint8), reference)

        # And the array form of write, with zero-length runs mixed in (skipped).
        data2 = rng.integers(0, 256, count * nbytes, dtype=np.uint8)
        lengths = np.where(np.arange(count) % 7 == 3, 0, nbytes)
        write_to_arrays(peer.pid, data2.ctypes.data + np.arange(count) * nbytes, base + targets, lengths)
        written = lengths > 0
        reference[targets[written, None] + np.arange(nbytes)] = data2.reshape(count, nbytes)[written]
        np.testing.assert_array_equal(np.frombuffer(peer.call("dump", "c"), dtype=np.uint8), reference)


def test_empty_and_zero_length_runs_are_no_ops() -> None:
    read_from(os.getpid(), [])
    write_to(os.getpid(), [])
    # A zero-length run never reaches the kernel, so even an unmapped address is fine.
    read_from(os.getpid(), [VmRun(0x10, 0x10, 0)])
    read_from_arrays(os.getpid(), [], [], [])


def test_argument_checks() -> None:
    with pytest.raises(ValueError, match="VmRun"):
        VmRun(-1, 0, 1)
    with pytest.raises(ValueError, match="VmRun"):
        VmRun(0, 1 << 64, 1)
    with pytest.raises(ValueError, match="VmRun"):
        VmRun(0, 0, 1 << 63)
    with pytest.raises(ValueError, match="differ in length"):
        read_from_arrays(os.getpid(), [1, 2], [1], [1, 1])
    with pytest.raises(ValueError, match="nbytes"):
        read_from_arrays(os.getpid(), [1], [1], [-1])
    with pytest.raises(TypeError, match="integers"):
        read_from_arrays(os.getpid(), [1.5], [1], [1])
    with pytest.raises(ValueError, match="pid"):
        read_from(0, [VmRun(1, 1, 1)])


# --- refusals -------------------------------------------------------------------------------------------


def test_unmapped_addresses_and_probe_on_a_live_child(seed: int) -> None:
    local = np.zeros(64, dtype=np.uint8)
    with child() as peer:
        base = peer.call("alloc", "a", SIZES["a"], seed)
        probe(peer.pid, base)
        probe(peer.pid, base + SIZES["a"] - 1)
        with pytest.raises(VmBadAddress, match=rf"pid {peer.pid}.*EFAULT") as raised:
            read_from(peer.pid, [VmRun(local.ctypes.data, 0x10, 64)])
        assert raised.value.errno == errno.EFAULT
        with pytest.raises(VmBadAddress):
            probe(peer.pid, 0x10)
        with pytest.raises(VmBadAddress):  # the local side unmapped
            read_from(peer.pid, [VmRun(0x10, base, 64)])
        with pytest.raises(VmBadAddress):
            write_to(peer.pid, [VmRun(local.ctypes.data, 0x10, 64)])
        assert peer.call("verify", "a", seed) is True


def test_a_reaped_pid_is_gone(seed: int) -> None:
    with child() as peer:
        base = peer.call("alloc", "a", SIZES["a"], seed)
        pid = peer.pid
        peer.stop()
    assert peer.process.exitcode == 0
    local = np.zeros(16, dtype=np.uint8)
    with pytest.raises(VmProcessGone, match=rf"pid {pid}.*ESRCH"):
        read_from(pid, [VmRun(local.ctypes.data, base, 16)])
    with pytest.raises(VmProcessGone):
        write_to(pid, [VmRun(local.ctypes.data, base, 16)])
    with pytest.raises(VmProcessGone):
        probe(pid, base)


def _forked_reader(write_fd: int, target_addr: int, local_addr: int) -> None:
    """Runs in the forked child: becomes nobody, then tries to read its (root) parent. Never returns."""
    outcome = "unreached"
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        results = []
        for attempt in (
            lambda: read_from(os.getppid(), [VmRun(local_addr, target_addr, 64)]),
            lambda: probe(os.getppid(), target_addr),
        ):
            try:
                attempt()
                results.append("ok")
            except VmError as error:
                results.append(f"{type(error).__name__}:{error.errno}")
        outcome = ",".join(results)
    except BaseException as error:
        outcome = f"crashed:{error!r}"
    finally:
        with contextlib.suppress(BaseException):
            os.write(write_fd, outcome.encode())
        os._exit(0)


def test_a_lower_privileged_reader_is_refused() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to uid 65534 in a forked child")
    target = np.arange(64, dtype=np.uint8)
    local = np.zeros(64, dtype=np.uint8)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_fd)
        _forked_reader(write_fd, target.ctypes.data, local.ctypes.data)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], TIMEOUT_S)
        outcome = os.read(read_fd, 4096).decode() if ready else "no answer"
    finally:
        os.close(read_fd)
        deadline = time.monotonic() + TIMEOUT_S
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    refused = f"{VmNotPermitted.__name__}:{errno.EPERM}"
    assert outcome == f"{refused},{refused}"  # read_from, then probe


# --- short transfers ------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munmap.restype = ctypes.c_int
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mprotect.restype = ctypes.c_int


@contextlib.contextmanager
def two_pages(second_page_prot: int) -> Iterator[np.ndarray]:
    """Two private anonymous pages (libc mmap, so no Python object pins them), the second with protection
    `second_page_prot`: do not touch it from Python. Unmapped afterwards; drop the view by then."""
    addr = _libc.mmap(
        None, 2 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
    )
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        view = np.frombuffer((ctypes.c_uint8 * (2 * PAGE)).from_address(addr), dtype=np.uint8)
        view[:] = pattern(7, "pages", 2 * PAGE)
        assert _libc.mprotect(addr + PAGE, PAGE, second_page_prot) == 0
        yield view
    finally:
        assert _libc.munmap(addr, 2 * PAGE) == 0


def test_a_read_that_runs_into_an_unreadable_page_stops_there() -> None:
    """The kernel moves what it can reach and returns short; the retry from that byte raises and names the
    run. The bad run sits in the second IOV_MAX batch, behind skipped zero-length runs the message counts."""
    with two_pages(PROT_NONE) as source:
        prefix_count, good = 1500, PAGE // 64
        prefix = np.zeros(prefix_count * 8, dtype=np.uint8)
        local = np.zeros((good + 2) * 64, dtype=np.uint8)
        runs = []
        for i in range(prefix_count):
            runs.append(VmRun(prefix.ctypes.data + i * 8, source.ctypes.data + i * 8 % PAGE, 8))
            runs.append(VmRun(0x10, 0x10, 0))
        runs.extend(VmRun(local.ctypes.data + i * 64, source.ctypes.data + i * 64, 64) for i in range(good))
        bad_run = len(runs)  # half readable, half not
        runs.append(VmRun(local.ctypes.data + good * 64, source.ctypes.data + PAGE - 32, 64))
        runs.append(VmRun(local.ctypes.data + (good + 1) * 64, source.ctypes.data, 64))
        assert IOV_MAX < prefix_count + good < 2 * IOV_MAX
        with pytest.raises(VmBadAddress, match=rf"stopped at run {bad_run} .* 32 bytes not moved"):
            read_from(os.getpid(), runs)
        np.testing.assert_array_equal(prefix, np.resize(source[:PAGE], prefix_count * 8))
        np.testing.assert_array_equal(local[: good * 64], source[:PAGE])
        np.testing.assert_array_equal(local[good * 64 : good * 64 + 32], source[PAGE - 32 : PAGE])
        assert not local[good * 64 + 32 :].any()  # nothing after the failure moved


def test_one_write_that_runs_into_a_read_only_page_moves_the_first_page() -> None:
    with two_pages(mmap.PROT_READ) as target:
        before = target.copy()
        data = pattern(8, "data", 2 * PAGE)
        with pytest.raises(VmBadAddress, match=r"stopped at run 0 .* 4096 bytes not moved"):
            write_to(os.getpid(), [VmRun(data.ctypes.data, target.ctypes.data, 2 * PAGE)])
        np.testing.assert_array_equal(target[:PAGE], data[:PAGE])
        np.testing.assert_array_equal(target[PAGE:], before[PAGE:])


# --- the kernel's rules here ----------------------------------------------------------------------------


def test_attach_rules_here() -> None:
    path = Path("/proc/sys/kernel/yama/ptrace_scope")
    scope = int(path.read_text()) if path.exists() else None
    assert ptrace_scope() == scope
    assert allow_peers_to_attach() is True
    assert allow_peers_to_attach() is True  # idempotent
    if scope in (None, 0, 1):
        assert cross_memory_supported() is None
    assert cross_memory_supported() is cross_memory_supported()  # cached


# --- measurement (printed, never asserted) --------------------------------------------------------------


def _best_gbps(action: Any, nbytes: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def test_measure_bandwidth() -> None:
    nbytes, run_nbytes = 64 << 20, 1 << 20
    with child() as peer:
        base = peer.call("fill", "big", nbytes)
        local = np.ones(nbytes, dtype=np.uint8)  # touched, so page faults are not measured
        one_run = [VmRun(local.ctypes.data, base, nbytes)]
        count = nbytes // run_nbytes
        many_runs = [  # remote run i lands in local slot count-1-i
            VmRun(local.ctypes.data + (count - 1 - i) * run_nbytes, base + i * run_nbytes, run_nbytes)
            for i in range(count)
        ]
        one = _best_gbps(lambda: read_from(peer.pid, one_run), nbytes)
        many = _best_gbps(lambda: read_from(peer.pid, many_runs), nbytes)
        np.testing.assert_array_equal(
            local.reshape(count, run_nbytes)[::-1].reshape(-1), cheap_pattern(nbytes)
        )
    source = np.full(nbytes, 3, dtype=np.uint8)
    copyto = _best_gbps(lambda: np.copyto(local, source), nbytes)
    print(
        f"\nread_from one 64 MiB run: {one:.2f} GB/s; 64 runs of 1 MiB: {many:.2f} GB/s; "
        f"np.copyto 64 MiB in-process: {copyto:.2f} GB/s"
    )
