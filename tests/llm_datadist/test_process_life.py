"""A process's life around an initialised instance: a fork after init (the child's copy of the parent's
instance is refused with a hint, the child may init its own and pull from its parent, and nothing the
child does or leaves at exit harms the parent), and SIGTERM (the instance is finalized and the process
ends as SIGTERM would, leaving nothing behind, unless the program set its own handler or turned it off).

Each scenario is a script of its own in a fresh process, as a user's program would be."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llm_datadist._shm.reaper import list_segments, reap

PREAMBLE = """
import os, signal, sys, time
import multiprocessing as mp
import numpy as np
from llm_datadist import (
    CacheDesc, CacheKey, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMException, LLMRole,
    LLMStatusCode,
)
from llm_datadist.ext import tensor_views

DESC = CacheDesc(num_tensors=2, shape=[1, 4 << 20], data_type=DataType.DT_INT8)
PORT = int(sys.argv[1])


def options(listen=None):
    config = LLMConfig()
    config.device_id = 0
    if listen:
        config.listen_ip_info = listen
    return config.generate_options()


def pull(cluster_id, req_id, base):
    dd = LLMDataDist(LLMRole.DECODER, cluster_id)
    dd.init(options())
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_remote_ip_info("127.0.0.1", PORT)
    ret, codes = dd.link_clusters([cluster], timeout=5000)
    assert ret == LLMStatusCode.LLM_SUCCESS, codes
    batch = dd.kv_cache_manager.allocate_cache(DESC)
    dd.kv_cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=req_id), batch)
    assert all(np.all(t == base + i) for i, t in enumerate(tensor_views(batch)))
    dd.unlink_clusters([cluster])
    dd.finalize()


def sockets():
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                found.append(int(fd))
        except OSError:
            pass
    return found
"""

FORK = """
if __name__ == "__main__":
    prompt = LLMDataDist(LLMRole.PROMPT, 1)
    prompt.init(options(f"127.0.0.1:{PORT}"))
    kvm = prompt.kv_cache_manager
    for req_id, base in ((1, 10), (2, 20)):
        cache = kvm.allocate_cache(DESC, [CacheKey(prompt_cluster_id=1, req_id=req_id)])
        for i, tensor in enumerate(tensor_views(cache)):
            tensor[...] = base + i
    assert sockets(), "the Prompt serves through sockets"
    pid = os.fork()
    if pid == 0:
        # The child: its copies of the parent's sockets are closed; the parent's instance is refused.
        assert not sockets(), sockets()
        try:
            kvm.allocate_cache(DESC)
        except LLMException as exc:
            assert exc.status_code == LLMStatusCode.LLM_FAILED
            assert "forkserver" in str(exc) and str(os.getppid()) in str(exc), str(exc)
        else:
            raise AssertionError("the parent's instance worked in the child")
        prompt.finalize()  # the parent's: nothing happens
        pull(9, 1, 10)  # an instance of its own, which pulls from the parent
        print("CHILD OK", flush=True)
        sys.exit(0)  # a normal exit: atexit hooks and finalizers run, and must not touch the parent's
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        assert time.monotonic() < deadline, "the child did not end"
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0, status
    # The parent still serves, from the index the child's exit left alone.
    decoder = mp.get_context("spawn").Process(target=pull, args=(8, 2, 20))
    decoder.start()
    decoder.join(60)
    assert decoder.exitcode == 0, decoder.exitcode
    prompt.finalize()
    print("PARENT OK", flush=True)
"""

SIGTERM = """
import faulthandler
faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack if the program hangs
if __name__ == "__main__":
    if "own-handler" in sys.argv:
        def mine(signum, frame):
            print("OWN HANDLER", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, mine)
    before = sorted(os.listdir("/proc/self/task"))  # the program's own threads (numpy's among them)
    prompt = LLMDataDist(LLMRole.PROMPT, 1)
    prompt.init(options(f"127.0.0.1:{PORT}"))
    cache = prompt.kv_cache_manager.allocate_cache(DESC, [CacheKey(prompt_cluster_id=1, req_id=1)])
    if "main-holds-lock" in sys.argv:
        # As if SIGTERM came while the main thread was inside a call that holds the table lock.
        prompt._core.table.lock.acquire()
    if "thread-holds-lock" in sys.argv:
        import threading
        held = threading.Event()
        def hold():
            prompt._core.table.lock.acquire()  # a thread stuck with the lock, never to give it back
            held.set()
            time.sleep(120)
        threading.Thread(target=hold, daemon=True).start()
        held.wait(10)
    print("READY", " ".join(before), flush=True)
    time.sleep(60)
"""


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "program.py"
    path.write_text(textwrap.dedent(PREAMBLE) + textwrap.dedent(body))
    return path


def _port() -> int:
    return 27000 + os.getpid() % 2000


def test_a_fork_after_init_gives_the_child_its_own_instance(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(_script(tmp_path, FORK)), str(_port())],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CHILD OK" in result.stdout and "PARENT OK" in result.stdout


def _start(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], list[str]]:
    """The running program, once it said READY, and the ids of the threads it had before `init`."""
    program = subprocess.Popen(
        [sys.executable, str(_script(tmp_path, SIGTERM)), str(_port()), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, **(env or {})),
    )
    assert program.stdout is not None
    line = program.stdout.readline()  # blocks until READY (or the program's end)
    assert line.startswith("READY"), line + program.stdout.read()
    return program, line.split()[1:]


def _wait(program: subprocess.Popen[str]) -> int:
    """The program's exit status; if it has not ended within 30 s, its threads' stacks in the failure."""
    try:
        return program.wait(30)
    except subprocess.TimeoutExpired:
        program.send_signal(signal.SIGUSR1)
        time.sleep(1)
        program.kill()
        output = program.communicate(timeout=30)[0]
        raise AssertionError(f"the program did not end within 30 s of SIGTERM:\n{output}") from None


def _left_by(pid: int) -> list[str]:
    return [info.name for info in list_segments() if info.owner.pid == pid]


def _sockets_in(runtime: Path) -> list[str]:
    return sorted(p.name for p in runtime.glob("*.sock")) if runtime.exists() else []


def _threads_taking(pid: int, signum: int) -> list[str]:
    """The threads of `pid` that do not block `signum` (any of them may be handed it by the kernel)."""
    taking = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = dict(
            line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line
        )
        if not int(status["SigBlk"], 16) >> (signum - 1) & 1:
            taking.append(f"{task.name} ({status['Name'].strip()})")
    return taking


def test_sigterm_finalizes_and_ends_the_process_as_sigterm_would(tmp_path: Path, _runtime_dir: Path) -> None:
    program, before_init = _start(tmp_path)
    try:
        assert _left_by(program.pid) and _sockets_in(_runtime_dir)
        # No thread of the library takes SIGTERM or SIGINT: one delivered there would wait for the main
        # thread's sleep to end before its handler ran.
        for signum in (signal.SIGTERM, signal.SIGINT):
            taking = [t for t in _threads_taking(program.pid, signum) if t.split()[0] not in before_init]
            assert taking == [], (signum, taking)
        program.send_signal(signal.SIGTERM)
        assert _wait(program) == -signal.SIGTERM
    finally:
        if program.poll() is None:
            program.kill()
            program.wait(30)
    assert _left_by(program.pid) == []
    assert _sockets_in(_runtime_dir) == []


def test_sigterm_is_left_alone_when_turned_off(tmp_path: Path, _runtime_dir: Path) -> None:
    program, _ = _start(tmp_path, env={"LLM_DATADIST_SIGTERM": "0"})
    program.send_signal(signal.SIGTERM)
    assert program.wait(30) == -signal.SIGTERM
    try:
        assert _left_by(program.pid), "with the handler off, SIGTERM kills the process where it stands"
    finally:
        reap()  # its owner is dead: what it left is removed as `llm-datadist gc` would


def test_a_program_s_own_sigterm_handler_is_kept(tmp_path: Path) -> None:
    program, _ = _start(tmp_path, "own-handler")
    program.send_signal(signal.SIGTERM)
    assert program.wait(30) == 3  # its handler ran (and exited 3); atexit finalized the instance
    assert program.stdout is not None
    assert "OWN HANDLER" in program.stdout.read()
    deadline = time.monotonic() + 5
    while _left_by(program.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _left_by(program.pid) == []


@pytest.mark.parametrize("holder", ["main-holds-lock", "thread-holds-lock"])
def test_sigterm_while_the_table_lock_is_held_still_leaves_nothing_behind(
    tmp_path: Path, _runtime_dir: Path, holder: str
) -> None:
    """Finalize needs the table lock: held by the main thread the handler interrupted, it cannot run; held
    by a stuck thread, it does not end within 5 s. Either way the process ends as SIGTERM would, and what
    the instance made (segments, its socket file) is unlinked without finalize."""
    program, _ = _start(tmp_path, holder)
    try:
        assert _left_by(program.pid) and _sockets_in(_runtime_dir)
        program.send_signal(signal.SIGTERM)
        assert _wait(program) == -signal.SIGTERM
    finally:
        if program.poll() is None:
            program.kill()
            program.wait(30)
        left = _left_by(program.pid)
        reap()
    assert left == []
    assert _sockets_in(_runtime_dir) == []
