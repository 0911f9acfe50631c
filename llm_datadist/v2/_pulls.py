"""`CacheManager.pull_cache` and `pull_blocks`: a pull the peer resolves and pins, or, with remote cache
access, a one-sided read of the peer's table (`Core.oneside`).

Rules: every argument is checked before anything is read; a one-sided pull's checked arguments become a
`PreparedRead`, kept by the arguments that made it but a `pull_blocks`' block lists (at most
`_MAX_PREPARED`), so that a later pull of the same plan into the same live cache checks only its block
lists and goes straight to `OneSided.run`, which checks the remote side afresh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._keys import KEY_BLOCKS
from .._owner.records import CacheRecord
from .._puller.movers import UnitRun
from .._puller.oneside import PreparedRead, RunsFor
from .._puller.source import V2, SourceRef
from .._stats import GEN_V2, PULL, READ
from .._transfer import (
    TensorSelection,
    key_fields,
    parse_layer_kwargs,
)
from .._validate import (
    U64_MAX,
    check_index_lists,
    check_int64,
    check_isinstance,
    check_uint32,
)
from ..status import LLMException, LLMStatusCode, make_error
from .cache import Cache
from .llm_types import (
    BlocksCacheKey,
    CacheKey,
    CacheKeyByIdAndIndex,
)

if TYPE_CHECKING:
    from .._core import Core
from ._base import ManagerBase, _invalid, _timeout_errors

# Prepared pulls kept per manager; past this many the memo starts over (a connector repeats a few shapes).
_MAX_PREPARED = 1024
# The one-sided pulls' error translators: they keep nothing of a call, so one serves every call and thread.
_ONE_SIDED_ERRORS = {api: _timeout_errors(api) for api in ("pull_cache", "pull_blocks")}


class Pulls(ManagerBase):
    """The pulls of `CacheManager`."""

    def _prepared_pull(
        self, key: tuple[object, ...] | None, cache: object
    ) -> tuple[Core, PreparedRead] | None:
        """The prepared read for `key` if its record is still the live cache `cache` names, else None (the
        caller then takes the full path, which raises whatever a changed state calls for)."""
        if key is None:
            return None
        with self._lock:
            entry = self._prepared.get(key)
        if entry is None or entry[0] is not self._core:
            return None
        record = entry[1].record
        # The record is the cache's while it lives (ids are never reused in an instance); the local pin
        # refuses it once the user unregistered it.
        if (
            type(cache) is not Cache
            or getattr(cache, "_manager", None) is not self
            or not cache._tensor_addrs
            or not record.external
        ):
            return None
        return entry

    def _remember(self, key: tuple[object, ...] | None, core: Core, read: PreparedRead) -> None:
        if key is None:
            return
        with self._lock:
            if len(self._prepared) >= _MAX_PREPARED:
                self._prepared.clear()
            self._prepared[key] = (core, read)

    def _run_one_sided(
        self, api: str, core: Core, read: PreparedRead, runs_for: RunsFor | None = None
    ) -> None:
        try:
            with _ONE_SIDED_ERRORS[api]:
                core.oneside.run(read, runs_for)
        except LLMException as exc:
            core.stats.failed(GEN_V2, READ, exc.status_code)
            raise

    def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        **kwargs: Any,
    ) -> None:
        """Pull the remote slot into slot `batch_index` of `cache` (not a blocks cache). `size` -1 means the
        local slot; the remote slot must hold it. kwargs: src_layer_range, dst_layer_range,
        tensor_num_per_layer; other names (v1's offsets too) are ignored, as in the real v2. With remote
        cache access on, the key must be a CacheKeyByIdAndIndex (TypeError otherwise)."""
        api = "pull_cache"
        memo_key: tuple[object, ...] | None = None
        if (
            not kwargs
            and type(cache_key) is CacheKeyByIdAndIndex
            and type(batch_index) is int
            and type(size) is int
        ):
            memo_key = (
                api,
                cache_key.cluster_id,
                cache_key.cache_id,
                cache_key.batch_index,
                getattr(cache, "cache_id", None),
                batch_index,
                size,
            )
            prepared = self._prepared_pull(memo_key, cache)
            if prepared is not None:
                self._run_one_sided(api, *prepared)
                return
        core = self._require_core(api)
        if core.settings.remote_cache_accessible:
            check_isinstance("cache_key", cache_key, CacheKeyByIdAndIndex)
        else:
            check_isinstance("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
        check_isinstance("cache", cache, Cache)
        check_uint32("batch_index", batch_index)
        check_int64("size", size)
        record = self._record_of(api, core, cache)
        if record.is_blocks:
            _invalid(api, "the destination of pull_cache must not be a blocks cache")
        if size != -1 and size <= 0:
            _invalid(api, f"size must be -1 or > 0, got {size}")
        if isinstance(cache_key, CacheKey):
            self.check_cache_key(cache_key)
        layers = parse_layer_kwargs(kwargs)
        if batch_index >= record.batch_size:
            _invalid(api, f"batch_index {batch_index} out of range for {record.batch_size} slots")
        selection = self._layers(api, layers, record.num_tensors)
        nbytes = record.slot_nbytes if size == -1 else size
        if nbytes > record.slot_nbytes:
            _invalid(api, f"size {nbytes} exceeds the local slot of {record.slot_nbytes} bytes")
        local_offset = batch_index * record.slot_nbytes

        def runs_for(slot: int, unit_nbytes: int, num_units: int) -> list[UnitRun]:
            if nbytes > unit_nbytes:
                raise make_error(
                    api, LLMStatusCode.LLM_PARAM_INVALID, f"{nbytes} bytes exceed the remote slot"
                )
            if slot >= num_units:
                raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"remote slot {slot} out of range")
            return [UnitRun(slot * unit_nbytes, local_offset, nbytes)]

        if core.settings.remote_cache_accessible:
            assert isinstance(cache_key, CacheKeyByIdAndIndex)
            read = _read(
                record,
                cache_key.cluster_id,
                (cache_key.cache_id, None, cache_key.batch_index),
                selection,
                runs_for,
                True,
            )
            self._remember(memo_key, core, read)
            self._run_one_sided(api, core, read)
            return
        try:
            with self._timeout_errors(api), core.pins.pinned(record.cache_id) as pinned:
                self._pull_resolved(core, key_fields(api, cache_key), pinned, selection, runs_for)
        except LLMException as exc:
            core.stats.failed(GEN_V2, PULL, exc.status_code)
            raise

    def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: list[int] | tuple[int, ...] = (),
        dst_blocks: list[int] | tuple[int, ...] = (),
        **kwargs: Any,
    ) -> None:
        """Into a blocks cache: with a BlocksCacheKey, remote block `src_blocks[k]` to local `dst_blocks[k]`;
        with a CacheKey / CacheKeyByIdAndIndex (a continuous remote slot, `src_blocks` empty), the slot cut
        into local-block-sized pieces, piece k to `dst_blocks[k]`. kwargs as `pull_cache` (other names are
        ignored). With remote cache access a CacheKey has no one-sided meaning: LLM_PARAM_INVALID (the real
        library's engine refuses it)."""
        api = "pull_blocks"
        memo_key: tuple[object, ...] | None = None
        lists = _exact_int_lists(src_blocks, dst_blocks)
        key_type = type(src_cache_key)
        if (
            not kwargs
            and lists is not None
            and (key_type is BlocksCacheKey or key_type is CacheKeyByIdAndIndex)
        ):
            names = src_cache_key._names
            # The plan, whatever blocks it moves: serving clients pull new block tables every time.
            memo_key = (api, names, getattr(dst_cache, "_cache_id", None))
            prepared = self._prepared_pull(memo_key, dst_cache)
            if prepared is not None:
                core, read = prepared
                by_blocks, record = key_type is BlocksCacheKey, read.record
                if _blocks_fit(record, by_blocks, *lists):
                    block = record.tensor_nbytes // record.batch_size
                    self._run_one_sided(api, core, read, _blocks_runs(api, by_blocks, block, *lists))
                    return
        core = self._require_core(api)
        check_isinstance("src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey))
        check_isinstance("dst_cache", dst_cache, Cache)
        check_index_lists(src_blocks=src_blocks, dst_blocks=dst_blocks)
        # The plan below may be kept for later calls: it must not see the caller's lists change.
        src_blocks = tuple(src_blocks) if src_blocks is not None else ()
        dst_blocks = tuple(dst_blocks) if dst_blocks is not None else ()
        record = self._record_of(api, core, dst_cache, "dst_cache")
        if not record.is_blocks:
            _invalid(api, "the destination of pull_blocks must be a blocks cache")
        if not dst_blocks:
            _invalid(api, "dst_blocks must not be empty")
        if max(dst_blocks) >= record.batch_size:
            _invalid(api, f"dst block {max(dst_blocks)} >= the cache's {record.batch_size} blocks")
        by_blocks = isinstance(src_cache_key, BlocksCacheKey)
        if by_blocks and len(src_blocks) != len(dst_blocks):
            _invalid(api, "src_blocks and dst_blocks must have the same length")
        if isinstance(src_cache_key, CacheKey):
            self.check_cache_key(src_cache_key)
        if not by_blocks and src_blocks:
            _invalid(api, "src_blocks must be empty when pulling a continuous cache into blocks")
        if core.settings.remote_cache_accessible and isinstance(src_cache_key, CacheKey):
            _invalid(api, "with remote cache access a CacheKey cannot be pulled; use CacheKeyByIdAndIndex")
        layers = parse_layer_kwargs(kwargs)
        selection = self._layers(api, layers, record.num_tensors)
        runs_for = _blocks_runs(api, by_blocks, record.slot_nbytes, src_blocks, dst_blocks)
        if core.settings.remote_cache_accessible:
            if isinstance(src_cache_key, BlocksCacheKey):
                ids: tuple[int | None, int | None, int] = (None, src_cache_key.model_id, 0)
            else:
                assert isinstance(src_cache_key, CacheKeyByIdAndIndex)
                ids = (src_cache_key.cache_id, None, src_cache_key.batch_index)
            read = _read(record, src_cache_key.cluster_id, ids, selection, runs_for, False)
            self._remember(memo_key, core, read)
            self._run_one_sided(api, core, read)
            return
        try:
            with self._timeout_errors(api), core.pins.pinned(record.cache_id) as pinned:
                if isinstance(src_cache_key, BlocksCacheKey):
                    fields = (src_cache_key.cluster_id, KEY_BLOCKS, 0, src_cache_key.model_id, 0)
                else:
                    fields = key_fields(api, src_cache_key)
                self._pull_resolved(core, fields, pinned, selection, runs_for)
        except LLMException as exc:
            core.stats.failed(GEN_V2, PULL, exc.status_code)
            raise

    @staticmethod
    def _pull_resolved(
        core: Core,
        fields: tuple[int, int, int, int, int],
        local: CacheRecord,
        selection: TensorSelection,
        runs_for: RunsFor,
    ) -> None:
        """Pull through the peer, which resolves the key (fields as `_key_fields` gives them) and pins."""
        cluster_id, kind, key_id, model_id, slot = fields
        ref = SourceRef(
            kind,
            key_id,
            model_id,
            slot,
            selection.src_start,
            selection.count,
            selection.whole,
            consume=True,
            rules=V2,
        )
        core.transfers.transfer_resolved(
            cluster_id,
            ref,
            local,
            selection.dst_start,
            lambda loc: runs_for(loc.slot, loc.unit_nbytes, loc.num_units),
            count_as=(GEN_V2, PULL),
        )


def _read(
    record: CacheRecord,
    cluster_id: int,
    ids: tuple[int | None, int | None, int],
    selection: TensorSelection,
    runs_for: RunsFor,
    continuous_source: bool,
) -> PreparedRead:
    """A one-sided read of the remote cache `ids` names ((cache id, model id, slot), one of the first two
    None) into `record`."""
    cache_id, model_id, slot = ids
    return PreparedRead(
        record,
        cluster_id,
        cache_id,
        model_id,
        slot,
        selection.src_start,
        selection.dst_start,
        selection.count,
        selection.whole,
        runs_for,
        continuous_source,
    )


def _blocks_fit(
    record: CacheRecord, by_blocks: bool, src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...]
) -> bool:
    """Whether `pull_blocks`' block lists (exact ints) pass the checks its full path makes of them against
    the destination `record`: else that path runs, and says what is wrong."""
    if not dst_blocks or min(dst_blocks) < 0 or max(dst_blocks) >= record.batch_size:
        return False
    if by_blocks:
        return len(src_blocks) == len(dst_blocks) and min(src_blocks) >= 0 and max(src_blocks) <= U64_MAX
    return not src_blocks


def _blocks_runs(
    api: str, by_blocks: bool, block: int, src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...]
) -> RunsFor:
    """The runs of a `pull_blocks` into blocks of `block` bytes, for the remote cache a lookup finds: remote
    block `src_blocks[k]` to local `dst_blocks[k]` (`by_blocks`), or a continuous remote slot cut into local
    blocks, piece k to `dst_blocks[k]`."""

    def runs_for(slot: int, unit_nbytes: int, num_units: int) -> list[UnitRun]:
        if by_blocks:
            if unit_nbytes != block:
                _invalid(api, f"remote blocks are {unit_nbytes} bytes, local blocks {block}")
            if max(src_blocks) >= num_units:
                _invalid(api, f"src block {max(src_blocks)} >= the remote cache's {num_units} blocks")
            return [UnitRun(s * block, d * block, block) for s, d in zip(src_blocks, dst_blocks, strict=True)]
        if slot >= num_units:
            _invalid(api, f"remote slot {slot} out of range")
        pieces = -(-unit_nbytes // block)
        if pieces > len(dst_blocks):
            _invalid(api, f"a {unit_nbytes}-byte slot needs {pieces} blocks, {len(dst_blocks)} given")
        base = slot * unit_nbytes
        return [
            UnitRun(base + k * block, d * block, min(block, unit_nbytes - k * block))
            for k, d in enumerate(dst_blocks[:pieces])
        ]

    return runs_for


def _exact_int_lists(
    src_blocks: object, dst_blocks: object
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Both block lists as tuples when each is a list or tuple of exact ints (bools and subclasses hash like
    ints but must still meet the full checks), else None."""
    lists = []
    for values in (src_blocks, dst_blocks):
        if type(values) is not list and type(values) is not tuple:
            return None
        items = tuple(values)
        for value in items:  # a loop, not all(): cheaper for the few items of a pull
            if type(value) is not int:
                return None
        lists.append(items)
    return lists[0], lists[1]
