"""`LLMDataDist`: the front end (init/finalize, links, the manager properties).

Rules: one initialised instance per process (`llm_engine_instance`), finalised at exit by an atexit hook
that swallows `LLMException`, and on SIGTERM where the program left SIGTERM at its default (then the process
ends as SIGTERM would; `LLM_DATADIST_SIGTERM=0` leaves SIGTERM alone). A child forked after init closes its
copies of the parent's sockets, never uses, finalizes or unlinks the parent's instance, and may init its
own. Methods other than `init` raise `RuntimeError("llm datadist is not initialized")` before `init`.
`link_clusters`/`unlink_clusters` never raise for a failed link: they return the overall code and one code
per cluster, as the real library does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
from types import FrameType
from typing import ClassVar

from .._core import Core
from .._errors import FORK_HINT, api_errors
from .._rank_table import check_link_args
from .._runtime import parse_listen_ip_info
from .._settings import parse_options
from .._validate import check_dict, check_int32, check_isinstance, check_uint64
from ..configs import LLMClusterInfo, LLMRole, ip_int_to_str, parse_v1_listen_ip_info
from ..status import LLMException, LLMStatusCode, make_error
from ..utils.log import log
from ..v1.kv_cache_manager import KvCacheManager
from .cache_manager import CacheManager
from .llm_types import RegisterMemStatus

MAX_CLUSTERS_PER_CALL = 16
_atexit_registered = False
# "0": init leaves SIGTERM alone (the program's own handler, or the default: no clean-up).
ENV_SIGTERM = "LLM_DATADIST_SIGTERM"
# How long a SIGTERM waits for the instance to finalize before the process ends anyway (what is left then
# is removed by the next init or `llm-datadist gc`: its owner is dead). Under docker stop's 10 s grace.
_SIGTERM_FINALIZE_S = 5.0


def _finalize_at_exit() -> None:
    instance = LLMDataDist.llm_engine_instance
    if instance is not None:
        with contextlib.suppress(LLMException):
            instance.finalize()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Finalize (on a thread of its own, bounded: another thread may hold what finalize waits for), then
    end the process as SIGTERM would: the default action, re-raised. When finalize cannot run (the main
    thread, interrupted here, holds the table lock it needs) or does not end in time, the names the
    instance made are unlinked without it (`Core.last_resort`)."""
    instance = LLMDataDist.llm_engine_instance
    core = instance._core if instance is not None else None
    if instance is not None and core is not None and core.forked_from is None:
        finished = False
        if not core.holds_lock_here():
            finisher = threading.Thread(target=_finalize_at_exit, name="llmdd-sigterm", daemon=True)
            finisher.start()
            finisher.join(_SIGTERM_FINALIZE_S)
            finished = not finisher.is_alive()
        if not finished:
            with contextlib.suppress(Exception):
                core.last_resort()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _handle_sigterm() -> None:
    """At init: SIGTERM finalizes, where the program left it at its default and we are on the main thread
    (the only one Python lets set a handler); `LLM_DATADIST_SIGTERM=0` turns this off."""
    if os.environ.get(ENV_SIGTERM, "").strip() == "0":
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _leave_sigterm() -> None:
    """At finalize: SIGTERM is the default again, if the handler is still ours."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is _on_sigterm
    ):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _after_fork_in_child() -> None:
    """The instance the parent initialised is not the child's: close the child's copies of its sockets and
    files (`Core.abandon`) and let the child init its own. No lock: the child has one thread, and a lock
    another thread of the parent held at the fork stays held in the child."""
    LLMDataDist._instance_lock = threading.Lock()
    instance, LLMDataDist.llm_engine_instance = LLMDataDist.llm_engine_instance, None
    core = instance._core if instance is not None else None
    if core is not None and core.forked_from is None:
        core.abandon(os.getppid())


os.register_at_fork(after_in_child=_after_fork_in_child)


class LLMDataDist:
    """`LLMDataDist(role, cluster_id)`: the process's KV-transfer endpoint.

    On this host, a side with `listen_ip_info` serves a Unix socket in the runtime directory named after
    that ip:port, and `link_clusters` connects to the socket named after the remote ip:port it is given.
    """

    llm_engine_instance: ClassVar[LLMDataDist | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole)
        check_uint64("cluster_id", cluster_id)
        self._role = role
        self._cluster_id = cluster_id
        self._core: Core | None = None
        self._kv_cache_manager: KvCacheManager | None = None
        self._cache_manager: CacheManager | None = None

    # ------------------------------------------------------------------ lifecycle

    def init(self, options: dict[str, str]) -> None:
        """Start the instance from option strings (`LLMConfig.generate_options()` or a raw dict)."""
        global _atexit_registered
        with LLMDataDist._instance_lock:
            if self._core is not None:
                return
            current = LLMDataDist.llm_engine_instance
        # As in the real init: another initialised instance is refused before the options are looked at.
        if current is not None and current is not self:
            raise LLMException("Cannot init multiple LLMDataDists", status_code=LLMStatusCode.LLM_FAILED)
        check_isinstance("options", options, dict)
        settings = parse_options(self._role, self._cluster_id, dict(options))
        if settings.cache_manager_mode and len(settings.device_ids) > 1:
            raise make_error(
                "init", LLMStatusCode.LLM_PARAM_INVALID, "cache-manager mode takes one device_id"
            )
        with LLMDataDist._instance_lock:
            if self._core is not None:
                return  # another thread initialised this instance meanwhile
            current = LLMDataDist.llm_engine_instance
            if current is not None and current is not self:
                raise LLMException("Cannot init multiple LLMDataDists", status_code=LLMStatusCode.LLM_FAILED)
            with api_errors("init"):
                core = Core(settings)
            self._core = core
            if settings.cache_manager_mode:
                self._cache_manager = CacheManager(core)
            else:
                self._kv_cache_manager = KvCacheManager(core, self._role)
            LLMDataDist.llm_engine_instance = self
            if not _atexit_registered:
                atexit.register(_finalize_at_exit)
                _atexit_registered = True
            _handle_sigterm()
        log.info("llm datadist %d initialised as %s", self._cluster_id, self._role)

    def finalize(self) -> None:
        """Release everything: links, the listening socket, every cache and its shared memory."""
        with LLMDataDist._instance_lock:
            core, self._core = self._core, None
            if core is None:
                return
            if core.forked_from is not None:
                return  # the parent's instance, inherited by a fork: the parent finalizes it
            if self._kv_cache_manager is not None:
                self._kv_cache_manager._finalize()
            if self._cache_manager is not None:
                self._cache_manager._finalize()
            self._kv_cache_manager = self._cache_manager = None
            if LLMDataDist.llm_engine_instance is self:
                LLMDataDist.llm_engine_instance = None
                _leave_sigterm()
        core.close()

    def _require_core(self) -> Core:
        core = self._core
        if core is None:
            raise RuntimeError("llm datadist is not initialized")
        if core.forked_from is not None:
            raise make_error("LLMDataDist", LLMStatusCode.LLM_FAILED, FORK_HINT.format(pid=core.forked_from))
        return core

    # ------------------------------------------------------------------ properties

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        """The v1 manager; LLMException(LLM_PARAM_INVALID) in cache-manager mode."""
        self._require_core()
        if self._kv_cache_manager is None:
            raise make_error(
                "kv_cache_manager", LLMStatusCode.LLM_PARAM_INVALID, "not available in cache-manager mode"
            )
        return self._kv_cache_manager

    @property
    def cache_manager(self) -> CacheManager:
        """The v2 manager; LLMException(LLM_PARAM_INVALID) in KvCacheManager mode."""
        self._require_core()
        if self._cache_manager is None:
            raise make_error(
                "cache_manager",
                LLMStatusCode.LLM_PARAM_INVALID,
                "cache_manager is only available in cache-manager mode",
            )
        return self._cache_manager

    def _v2(self, core: Core) -> bool:
        return core.settings.cache_manager_mode

    # ------------------------------------------------------------------ one-sided links

    @staticmethod
    def _check_clusters(clusters: object, timeout: object, api: str) -> list[LLMClusterInfo]:
        check_isinstance("clusters", clusters, (list, tuple))
        assert isinstance(clusters, (list, tuple))
        for cluster in clusters:
            check_isinstance("clusters", cluster, LLMClusterInfo)
        check_int32("timeout", timeout)
        assert isinstance(timeout, int)
        if timeout <= 0:
            raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"timeout must be > 0 ms, got {timeout}")
        return list(clusters)

    def link_clusters(
        self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to each cluster's listening side; returns (overall code, per-cluster codes), never raises
        for a failed link. `timeout` (ms) bounds the whole call."""
        api = "link_clusters"
        core = self._require_core()
        infos = self._check_clusters(clusters, timeout, api)
        if not self._v2(core) and self._role == LLMRole.PROMPT:
            raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, "in v1 only the DECODER (client) links")
        if self._v2(core):
            for info in infos:
                if not core.settings.local_comm_res and not info.local_ip_info_list:
                    raise make_error(
                        api,
                        LLMStatusCode.LLM_PARAM_INVALID,
                        "v2 link_clusters needs local ip info (or local_comm_res)",
                    )
                # The real v2 checks each id (TypeError for an unset one); v1 reports LLM_LINK_FAILED below.
                check_uint64("remote_cluster_id", info.remote_cluster_id)
        if len(infos) > MAX_CLUSTERS_PER_CALL:
            code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            return code, [code] * len(infos)
        deadline = time.monotonic() + timeout / 1000.0
        results: list[LLMStatusCode] = []
        for info in infos:
            if info.remote_cluster_id is None or not info.remote_ip_info_list:
                log.error("link_clusters: cluster info needs remote_cluster_id and a remote ip: %r", info)
                results.append(LLMStatusCode.LLM_LINK_FAILED)
                continue
            if _hixl_backend(core) and len(info.remote_ip_info_list) != 1:
                log.error("link_clusters: with the hixl backend a cluster takes one remote ip: %r", info)
                results.append(LLMStatusCode.LLM_PARAM_INVALID)
                continue
            ip, port = info.remote_ip_info_list[0]
            # Over TCP (a peer on another host) the link leaves from the local ip given, when it is ours.
            local_ip = ip_int_to_str(info.local_ip_info_list[0][0]) if info.local_ip_info_list else ""
            with api_errors(api):
                results.append(
                    core.links.link(info.remote_cluster_id, ip_int_to_str(ip), port, deadline, local_ip)
                )
        return _overall(results), results

    def unlink_clusters(
        self,
        clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
        timeout: int = 3000,
        force: bool = False,
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Tear links down. Without `force` the peer is told (it drops its end); with `force` only the
        local end goes, and a cluster with no link (never linked, or gone with a peer that finalized) is
        SUCCESS, as the real `UnlinkCluster` with its force flag ("Entity not found"). A link busy with a
        transfer gives LLM_LINK_BUSY for that cluster."""
        api = "unlink_clusters"
        core = self._require_core()
        infos = self._check_clusters(clusters, timeout, api)
        check_isinstance("force", force, bool)
        for info in infos:
            check_uint64("remote_cluster_id", info.remote_cluster_id)
        if len(infos) > MAX_CLUSTERS_PER_CALL:
            code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            return code, [code] * len(infos)
        results: list[LLMStatusCode] = []
        for info in infos:
            assert info.remote_cluster_id is not None  # checked above
            code = core.links.unlink(info.remote_cluster_id, force=force)
            if (
                code == LLMStatusCode.LLM_NOT_YET_LINK
                and self._v2(core)
                and core.drop_peer(info.remote_cluster_id)
            ):
                # v2: the serving side unlinks a client that linked to it.
                code = LLMStatusCode.LLM_SUCCESS
            elif code == LLMStatusCode.LLM_NOT_YET_LINK and force:
                log.info(
                    "unlink_clusters: cluster %d: entity not found (forced: success)", info.remote_cluster_id
                )
                code = LLMStatusCode.LLM_SUCCESS
            results.append(code)
        return _overall(results), results

    def check_link_status(self, remote_cluster_id: int) -> None:
        """Probe a link with one round trip bounded by `sync_kv_timeout`; raises LLMException on failure
        (LLM_LINK_BUSY while a transfer uses the link, LLM_NOT_YET_LINK without a link)."""
        api = "check_link_status"
        core = self._require_core()
        if self._v2(core):
            raise make_error(
                api, LLMStatusCode.LLM_PARAM_INVALID, "check_link_status is a KvCacheManager-mode API"
            )
        check_uint64("remote_cluster_id", remote_cluster_id)
        with api_errors(api):
            core.links.check(remote_cluster_id)

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        """Change this instance's role. v1: refuses the current role, a PROMPT needs
        `switch_options["llm.listenIpInfo"]`, and the instance needs `enable_switch_role`. v2: no same-role
        check; giving `llm.listenIpInfo` makes this side serve there (or moves it), leaving it out stops
        serving. Either way the old listen socket goes, and any remaining link (ours or a peer's to us) is
        LLM_EXIST_LINK. The argument checks come first and in the real order (see docs/conformance.md)."""
        api = "switch_role"
        core = self._require_core()
        check_isinstance("role", role, LLMRole)
        v2 = self._v2(core)
        if not v2 and role == self._role:
            raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"role not changed, role = {role.name}")
        if switch_options is not None:
            check_dict("switch_options", switch_options, str, str)
        options = switch_options or {}
        listen: tuple[str, int] | None = None
        if v2:
            if "llm.listenIpInfo" in options:
                # As the real v2: "ip:port" in two parts (PI), int(port) (ValueError); "" is one part.
                listen = parse_listen_ip_info(options["llm.listenIpInfo"], api=api)
        elif role == LLMRole.PROMPT:
            if "llm.listenIpInfo" not in options:
                raise make_error(
                    api, LLMStatusCode.LLM_PARAM_INVALID, "switching to PROMPT needs llm.listenIpInfo"
                )
            listen = parse_v1_listen_ip_info(api, options["llm.listenIpInfo"])
        # The real v1 leaves llm.EnableSwitchRole to the engine, after every check above.
        if not v2 and not core.settings.enable_switch_role:
            raise make_error(
                api, LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "init with enable_switch_role=True first"
            )
        if len(core.settings.device_ids) > 1:
            raise make_error(
                api, LLMStatusCode.LLM_PARAM_INVALID, "not supported with several devices in one process"
            )
        if v2 and _hixl_backend(core):
            # The hixl backend serves where init said, whatever the role: another address is refused.
            if listen is not None and listen != core.settings.listen:
                raise make_error(
                    api, LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "the hixl backend keeps init's listen_ip_info"
                )
            core.set_role(role)
            self._role = role
            return
        if core.links.clusters() or core.server.peers():
            raise make_error(api, LLMStatusCode.LLM_EXIST_LINK, "unlink every cluster first")
        with api_errors(api):
            core.stop_public()
            if listen is not None:
                core.listen_public(listen)
            core.set_role(role)
        self._role = role
        if self._kv_cache_manager is not None:
            self._kv_cache_manager._role = role

    # ------------------------------------------------------------------ two-sided links (v2 only)

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Two-sided link (v2): every member calls it at about the same time with the same name and table;
        it returns a comm_id at once and links in the background. Poll `query_register_mem_status(comm_id)`
        until OK (FAILED after `link_total_time` seconds, or HCCL_CONNECT_TIMEOUT, default 120)."""
        api = "link"
        core = self._require_core()
        if not self._v2(core):
            raise make_error(
                api, LLMStatusCode.LLM_PARAM_INVALID, "link is only available in cache-manager mode"
            )
        name, members, table = check_link_args(
            comm_name, cluster_rank_info, rank_table, local_cluster_id=self._cluster_id
        )
        _no_two_sided_links(api, core)
        with api_errors(api):
            return core.comms.link(name, members, table)

    def unlink(self, comm_id: int) -> None:
        """Tear down a two-sided link; LLM_LINK_BUSY while one of its links is transferring."""
        api = "unlink"
        core = self._require_core()
        if not self._v2(core):
            raise make_error(
                api, LLMStatusCode.LLM_PARAM_INVALID, "unlink is only available in cache-manager mode"
            )
        check_uint64("comm_id", comm_id)
        _no_two_sided_links(api, core)
        with api_errors(api):
            core.comms.unlink(comm_id)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """PREPARING until every member of the two-sided link is linked, then OK; FAILED when it timed out."""
        api = "query_register_mem_status"
        core = self._require_core()
        if not self._v2(core):
            raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, "only available in cache-manager mode")
        check_uint64("comm_id", comm_id)
        _no_two_sided_links(api, core)
        with api_errors(api):
            return RegisterMemStatus(core.comms.status(comm_id))


def _overall(results: list[LLMStatusCode]) -> LLMStatusCode:
    for code in results:
        if code != LLMStatusCode.LLM_SUCCESS:
            return code
    return LLMStatusCode.LLM_SUCCESS


def _hixl_backend(core: Core) -> bool:
    return core.settings.transfer_backend == "hixl"


def _no_two_sided_links(api: str, core: Core) -> None:
    """The hixl backend has no two-sided links: LLM_FEATURE_NOT_ENABLED, as its engine answers."""
    if _hixl_backend(core):
        raise make_error(
            api, LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "not supported by the hixl transfer backend"
        )
