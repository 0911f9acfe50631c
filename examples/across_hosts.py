"""The README's example, across two hosts: the same Prompt and Decoder code, with the Prompt's address and a
shared secret as the only changes. On each host, with the same secret:

    # host A (the Prompt), whose address the Decoder can reach, say 10.0.0.1
    export LLM_DATADIST_SECRET=...        # the same value on both hosts, at least 16 characters
    python examples/across_hosts.py prompt 10.0.0.1

    # host B (the Decoder)
    export LLM_DATADIST_SECRET=...
    python examples/across_hosts.py decoder 10.0.0.1

Both need `pip install -e '.[multihost]'` (Mooncake Transfer Engine moves the bytes). The Prompt serves
until Ctrl-C (or `--serve-seconds`). Without arguments, both sides run here as two processes over
127.0.0.1, where no secret is needed: the same calls, through shared memory.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from multiprocessing.connection import Connection

import numpy as np
from _pair import run_pair

from llm_datadist import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)
from llm_datadist.ext import tensor_views

PORT = 26010
DESC = CacheDesc(num_tensors=8, shape=[1, 256, 8, 128], data_type=DataType.DT_FLOAT16)  # 4 layers x K, V


def prompt(ip: str, stop: threading.Event, ready: Connection | None = None) -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"{ip}:{PORT}"  # Decoders link here (over TCP when they are on another host)
    dd.init(config.generate_options())
    cache = dd.kv_cache_manager.allocate_cache(DESC, [CacheKey(prompt_cluster_id=1, req_id=42)])
    for t, tensor in enumerate(tensor_views(cache)):  # or write through cache.per_device_tensor_addrs
        tensor[...] = t
    print(f"Prompt: request 42 is ready at {ip}:{PORT}", flush=True)
    if ready is not None:
        ready.send("ready")
    stop.wait()  # stay initialised while Decoders pull: finalize frees the cache
    dd.finalize()


def decoder(prompt_ip: str) -> None:
    dd = LLMDataDist(LLMRole.DECODER, 2)
    config = LLMConfig()
    config.device_id = 0
    dd.init(config.generate_options())
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_remote_ip_info(prompt_ip, PORT)
    ret, per_cluster = dd.link_clusters([cluster], timeout=5000)
    assert ret == LLMStatusCode.LLM_SUCCESS, per_cluster
    batch = dd.kv_cache_manager.allocate_cache(CacheDesc(8, [4, 256, 8, 128], DataType.DT_FLOAT16))
    dd.kv_cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=42), batch, batch_index=3)
    assert all(np.all(tensor[3] == t) for t, tensor in enumerate(tensor_views(batch)))
    print("Decoder: pulled request 42 into slot 3", flush=True)
    dd.unlink_clusters([cluster])
    dd.finalize()


# --------------------------------------------------------------------- one host: both sides, two processes
def _prompt_here(control: Connection) -> None:
    stop = threading.Event()
    threading.Thread(target=lambda: (control.recv(), stop.set()), daemon=True).start()
    prompt("127.0.0.1", stop, ready=control)


def _decoder_here(control: Connection) -> None:
    control.recv()  # the Prompt is ready
    decoder("127.0.0.1")
    control.send("done")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="side")
    serve = sub.add_parser("prompt", help="serve request 42 at IP:26010 until Ctrl-C")
    serve.add_argument("ip", help="this host's address the Decoder reaches")
    serve.add_argument("--serve-seconds", type=float, default=None, help="stop after this long")
    pull = sub.add_parser("decoder", help="link to the Prompt at PROMPT_IP:26010 and pull request 42")
    pull.add_argument("prompt_ip")
    args = parser.parse_args()
    if args.side == "prompt":
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        if args.serve_seconds is not None:
            threading.Timer(args.serve_seconds, stop.set).start()
        prompt(args.ip, stop)
        print("Prompt: stopped")
    elif args.side == "decoder":
        decoder(args.prompt_ip)
    else:
        run_pair(_prompt_here, _decoder_here)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
