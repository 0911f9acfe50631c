"""A real deployment's addresses on one host: device ips copied from an Ascend config (`listen_ip_info`
"192.168.100.7:26901", `append_remote_ip_info("192.168.100.7", 26901)`) link and pull unchanged, because a
link finds a listener of this user on this host at that ip:port first. An address nobody here listens at is
`LLM_LINK_FAILED` for that cluster, never an exception, and the log says what was tried and what to do.

Each scenario runs in a fresh network namespace that has only loopback (`unshare -n`), so no packet meant
for those addresses can leave the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llm_datadist._puller.remote import engine_available

PREAMBLE = """
import multiprocessing as mp
import numpy as np
from llm_datadist import (
    CacheDesc, CacheKey, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole, LLMStatusCode,
)
from llm_datadist.ext import tensor_views

DESC = CacheDesc(num_tensors=4, shape=[1, 3333], data_type=DataType.DT_INT8)


def prompt(ready, done, listen):
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = listen
    dd.init(config.generate_options())
    cache = dd.kv_cache_manager.allocate_cache(DESC, [CacheKey(prompt_cluster_id=1, req_id=7)])
    for t, tensor in enumerate(tensor_views(cache)):
        tensor[...] = t + 1
    ready.set()
    done.wait(60)
    dd.finalize()


def decoder(ip, port, local_ip):
    dd = LLMDataDist(LLMRole.DECODER, 2)
    config = LLMConfig()
    config.device_id = 0
    dd.init(config.generate_options())
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_local_ip_info(local_ip, 0)
    cluster.append_remote_ip_info(ip, port)
    return dd, cluster
"""

PULL = """
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    owner = ctx.Process(target=prompt, args=(ready, done, "192.168.100.7:26901"))
    owner.start()
    try:
        assert ready.wait(60), "the Prompt did not start"
        dd, cluster = decoder("192.168.100.7", 26901, "192.168.100.8")
        ret, per_cluster = dd.link_clusters([cluster], timeout=5000)
        assert ret == LLMStatusCode.LLM_SUCCESS, per_cluster
        batch = dd.kv_cache_manager.allocate_cache(CacheDesc(4, [2, 3333], DataType.DT_INT8))
        dd.kv_cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=7), batch, batch_index=1)
        assert all(np.all(tensor[1] == t + 1) for t, tensor in enumerate(tensor_views(batch)))
        assert dd.unlink_clusters([cluster])[0] == LLMStatusCode.LLM_SUCCESS
        dd.finalize()
        print("PULLED")
    finally:
        done.set()
        owner.join(30)
        if owner.is_alive():
            owner.kill()
            owner.join(10)
"""

NOBODY = """
import sys
if "no-extra" in sys.argv:
    sys.modules["mooncake"] = None  # as if the multihost extra were not installed
dd, cluster = decoder("192.168.100.9", 26902, "192.168.100.8")
ret, per_cluster = dd.link_clusters([cluster], timeout=3000)  # no exception: a code per cluster
print("RESULT", ret.name, [code.name for code in per_cluster])
dd.finalize()
"""


def _in_fresh_netns(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip for a network namespace of its own")
    path = tmp_path / "scenario.py"
    path.write_text(textwrap.dedent(PREAMBLE) + textwrap.dedent(script))
    env = dict(os.environ, ASCEND_GLOBAL_LOG_LEVEL="3", PYTHONPATH=os.getcwd())
    command = f'ip link set lo up && exec "{sys.executable}" "{path}" {" ".join(args)}'
    return subprocess.run(
        ["unshare", "-n", "sh", "-c", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_device_ips_of_a_real_config_link_and_pull_on_one_host(tmp_path: Path) -> None:
    result = _in_fresh_netns(tmp_path, PULL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PULLED" in result.stdout


@pytest.mark.parametrize("extra", ["no-extra", "extra-if-installed"])
def test_nobody_listening_at_a_device_ip_is_a_failed_code_that_says_why(tmp_path: Path, extra: str) -> None:
    result = _in_fresh_netns(tmp_path, NOBODY, extra)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "RESULT LLM_LINK_FAILED ['LLM_LINK_FAILED']" in result.stdout
    # The log line (stdout, as the real library's) names the address and what a one-host user should do.
    log = result.stdout
    assert "link to cluster 1 at 192.168.100.9:26902 failed" in log
    one_host = "nobody listens at 192.168.100.9:26902 on this host yet"
    assert one_host in log
    assert "start the listening side first" in log
    # The one-host advice comes first, then what another host would need.
    assert log.index(one_host) < log.index("If the peer is on another host")
    if extra == "no-extra" or engine_available() is not None:
        assert "llm-datadist-host[multihost]" in log
    else:  # the engine is there and the test sets no secret: the log says that is what is missing
        assert "no shared secret" in log
