"""The layer-wise push machinery behind `transfer_cache_async`: the background job and `CacheTask`.

Rules: one thread per call walks the source layers in order; for each layer some config wants it calls
the user's `LayerSynchronizer`, then pushes that layer into every wanting config's destination (one copy
into the peer's pinned memory). Results are kept per destination cluster id, as in the real library (two
configs to one cluster share a result). The job holds a pin on the source cache until it ends.

A config's destination is leased at its first layer; while the job waits in the user's synchronizer,
that lease is kept for at most `hold_s` (the transfer's timeout): then it is released, and the next layer
leases the destination again (failing if the peer's user freed or unregistered it meanwhile). A
synchronizer that never returns thus holds no memory of the peer's past that bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._alarms import alarms
from .._errors import StatusError
from .._signals import held
from .._validate import check_uint32
from ..status import LLMStatusCode
from ..utils.log import log
from .llm_types import LayerSynchronizer


@dataclass(frozen=True)
class LayerPush:
    """One config's part of the job: which source layers it wants, how to push one of them, and what ends
    its pushes (`end(ok)`, called once, when its last layer landed or it stopped: it lets go of what they
    hold)."""

    dst_cluster_id: int
    layers: range
    push_layer: Callable[[int], None]
    end: Callable[[bool], None] | None = None
    pause: Callable[[], None] | None = None  # let go of what it holds for now; the next layer takes it again


class TransferJob:
    """Runs the pushes of one `transfer_cache_async` call on its own thread."""

    def __init__(
        self,
        synchronizer: LayerSynchronizer,
        pushes: Sequence[LayerPush],
        num_layers: int,
        *,
        on_exit: Callable[[], None],
        on_failed: Callable[[LLMStatusCode], None] | None = None,
        hold_s: float | None = None,
        raised_code: LLMStatusCode | None = None,
    ) -> None:
        self._synchronizer = synchronizer
        # A synchronizer that raises ends the job: with `raised_code` (v2, the real thread's default code)
        # every config reports that code; without (v1, whose real thread just dies) the configs that had
        # not finished report nothing.
        self._raised_code = raised_code
        self._raised = False
        self._hold_s = hold_s
        # Serialises the pauses an alarm makes with the job's own use of its pushes.
        self._pausing = threading.Lock()
        self._waiting = False
        self._pushes = list(pushes)
        self._num_layers = num_layers
        self._on_exit = on_exit
        self._on_failed = on_failed
        self._results: dict[int, LLMStatusCode] = {}
        self._lock = threading.Lock()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmdd-transfer", daemon=True)

    def start(self) -> None:
        with held():  # SIGTERM and SIGINT are the program's main thread's (`_signals`)
            self._thread.start()

    def result(self, dst_cluster_id: int) -> LLMStatusCode | None:
        with self._lock:
            if self._raised and self._raised_code is not None:
                return self._raised_code
            return self._results.get(dst_cluster_id)

    def _record(self, dst_cluster_id: int, code: LLMStatusCode) -> None:
        with self._lock:
            self._results[dst_cluster_id] = code
        if code != LLMStatusCode.LLM_SUCCESS and self._on_failed is not None:
            try:
                self._on_failed(code)
            except Exception:
                log.exception("transfer_cache_async: counting a failure failed")

    def _run(self) -> None:
        active = list(self._pushes)
        try:
            for layer in range(self._num_layers):
                wanting = [push for push in active if layer in push.layers]
                if not wanting:
                    continue
                try:
                    ready = bool(self._synchronize(layer, active))
                except Exception as exc:
                    log.error(
                        "transfer_cache_async: synchronize_layer(%d) raised %r: the transfer ends with %s",
                        layer,
                        exc,
                        self._raised_code.name if self._raised_code is not None else "no result",
                    )
                    with self._lock:
                        self._raised = True
                    if self._raised_code is not None and self._on_failed is not None:
                        self._on_failed(self._raised_code)
                    return
                if not ready:
                    for push in wanting:
                        self._record(push.dst_cluster_id, LLMStatusCode.LLM_PARAM_INVALID)
                    return
                for push in wanting:
                    try:
                        push.push_layer(layer)
                    except StatusError as exc:
                        log.error("transfer_cache_async: layer %d to %d: %s", layer, push.dst_cluster_id, exc)
                        self._stop(active, push, exc.code)
                        continue
                    except Exception as exc:
                        log.error("transfer_cache_async: layer %d to %d: %r", layer, push.dst_cluster_id, exc)
                        self._stop(active, push, LLMStatusCode.LLM_FAILED)
                        continue
                    if layer == push.layers[-1]:
                        self._stop(active, push, LLMStatusCode.LLM_SUCCESS)
        finally:
            try:
                for push in active:  # stopped early: the synchronizer said no, or raised
                    _end(push, ok=False)
            finally:
                try:
                    self._on_exit()
                finally:
                    self.done.set()

    def _synchronize(self, layer: int, active: list[LayerPush]) -> bool:
        """The user's synchronizer for `layer`; what the active pushes hold is let go once it took
        `hold_s`."""
        if self._hold_s is None or not any(push.pause is not None for push in active):
            return bool(self._synchronizer.synchronize_layer(layer, None))
        pushes = list(active)

        def pause() -> None:
            with self._pausing:
                if not self._waiting:
                    return  # it returned meanwhile: the job has its pushes back
                log.warning(
                    "transfer_cache_async: synchronize_layer(%d) took over %.3f s: the destinations are "
                    "released until the next layer",
                    layer,
                    self._hold_s,
                )
                for push in pushes:
                    if push.pause is not None:
                        try:
                            push.pause()
                        except Exception:
                            log.exception(
                                "transfer_cache_async: releasing the pushes to %d", push.dst_cluster_id
                            )

        self._waiting = True
        alarm = alarms.at(time.monotonic() + self._hold_s, pause)
        try:
            return bool(self._synchronizer.synchronize_layer(layer, None))
        finally:
            alarm.cancel()
            with self._pausing:  # a pause under way ends before the job goes on
                self._waiting = False

    def _stop(self, active: list[LayerPush], push: LayerPush, code: LLMStatusCode) -> None:
        """`push` is over: what it holds is let go before its result says so."""
        active.remove(push)
        _end(push, ok=code == LLMStatusCode.LLM_SUCCESS)
        self._record(push.dst_cluster_id, code)


def _end(push: LayerPush, *, ok: bool) -> None:
    if push.end is None:
        return
    try:
        push.end(ok)
    except Exception:
        log.exception("transfer_cache_async: ending the pushes to %d failed", push.dst_cluster_id)


class CacheTask:
    """Handle of a `transfer_cache_async` call.

    `synchronize` and `get_results` wait for the job (`timeout_in_millis`, uint32 ms; None waits until the
    job ends, which the user's synchronizer bounds) and never raise on a timeout: they report the mode's
    timeout code instead, as the real library does.
    """

    def __init__(
        self, job: TransferJob, dst_cluster_ids: Sequence[int], *, timeout_code: LLMStatusCode
    ) -> None:
        self._job = job
        self._dst_cluster_ids = list(dst_cluster_ids)
        self._timeout_code = timeout_code

    def _wait(self, timeout_in_millis: int | None) -> bool:
        if timeout_in_millis is not None:
            check_uint32("timeout_in_millis", timeout_in_millis)
            return self._job.done.wait(timeout_in_millis / 1000.0)
        return self._job.done.wait()

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """The first non-success result in config order, or LLM_SUCCESS; a config with no result counts
        as success (the real library's quirk)."""
        if not self._wait(timeout_in_millis):
            return self._timeout_code
        for cluster_id in self._dst_cluster_ids:
            code = self._job.result(cluster_id)
            if code is not None and code != LLMStatusCode.LLM_SUCCESS:
                return code
        return LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """One result per transfer config, in order; None where the config's last layer was never sent."""
        if not self._wait(timeout_in_millis):
            return [self._timeout_code for _ in self._dst_cluster_ids]
        return [self._job.result(cluster_id) for cluster_id in self._dst_cluster_ids]
