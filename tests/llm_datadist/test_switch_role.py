"""`switch_role` (v1): the feature flag, the documented errors, and that a new PROMPT really serves."""

from __future__ import annotations

import os
import time

import pytest

from llm_datadist import CacheDesc, CacheKey, DataType, LLMException, LLMRole, LLMStatusCode
from tests._peer import PROMPT_IP, PromptPeer, decoder

PORT = 23000


def _code(exc_info: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc_info.value.status_code


def test_needs_enable_switch_role() -> None:
    with decoder() as dd, pytest.raises(LLMException) as exc_info:
        dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"{PROMPT_IP}:{PORT}"})
    assert _code(exc_info) == LLMStatusCode.LLM_FEATURE_NOT_ENABLED


def test_documented_errors(seed: int) -> None:
    with PromptPeer(1, PORT + 1, seed) as peer, decoder(extra={"llm.EnableSwitchRole": "1"}) as dd:
        with pytest.raises(LLMException) as exc_info:
            dd.switch_role(LLMRole.DECODER)
        assert _code(exc_info) == LLMStatusCode.LLM_PARAM_INVALID  # already DECODER
        with pytest.raises(LLMException) as exc_info:
            dd.switch_role(LLMRole.PROMPT)
        assert _code(exc_info) == LLMStatusCode.LLM_PARAM_INVALID  # PROMPT needs llm.listenIpInfo
        with pytest.raises(TypeError):
            dd.switch_role("PROMPT")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": 1})  # type: ignore[dict-item]
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
        with pytest.raises(LLMException) as exc_info:
            dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"{PROMPT_IP}:{PORT + 2}"})
        assert _code(exc_info) == LLMStatusCode.LLM_EXIST_LINK


def test_decoder_becomes_prompt_and_back(_runtime_dir) -> None:  # type: ignore[no-untyped-def]
    from llm_datadist._wire.client import ClientLink

    with decoder(5, extra={"llm.EnableSwitchRole": "1"}) as dd:
        kvm = dd.kv_cache_manager
        desc = CacheDesc(2, [1, 64], DataType.DT_FLOAT16)
        with pytest.raises(LLMException):
            kvm.allocate_cache(desc, [CacheKey(5, 1)])  # keys are a PROMPT's
        dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"{PROMPT_IP}:{PORT + 3}"})
        path = _runtime_dir / f"{PROMPT_IP}_{PORT + 3}.sock"
        assert path.exists()
        cache = kvm.allocate_cache(desc, [CacheKey(5, 1)])  # the manager follows the new role
        kvm.remove_cache_key(CacheKey(5, 1))
        with pytest.raises(LLMException) as exc_info:
            kvm.pull_cache(CacheKey(9, 1), cache)
        assert _code(exc_info) == LLMStatusCode.LLM_PARAM_INVALID  # a PROMPT does not pull
        # It really serves: a client links and is told it reached a PROMPT.
        link = ClientLink.connect(
            path, cluster_id=77, remote_cluster_id=5, role=2, deadline=time.monotonic() + 5
        )
        assert link.peer.role == int(LLMRole.PROMPT) and link.peer.pid == os.getpid()
        with pytest.raises(LLMException) as exc_info:
            dd.switch_role(LLMRole.DECODER)
        assert _code(exc_info) == LLMStatusCode.LLM_EXIST_LINK  # a peer is linked to us
        link.close(say_bye=True)
        deadline = time.monotonic() + 5
        while dd._require_core().server.peers():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        dd.switch_role(LLMRole.DECODER)
        deadline = time.monotonic() + 5
        while path.exists():
            assert time.monotonic() < deadline, "the old listen socket was not removed"
            time.sleep(0.01)
