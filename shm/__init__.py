"""POSIX shared memory for KV bytes: owner-tagged segments, pools of prefaulted blocks, cached mappings of
peers' segments, the reaper for dead owners' leftovers, and copy plans executed with numpy.

Owns bytes and lifetimes only: no sockets, no threads, no protocol. Not thread-safe; callers serialise.
"""

from .copyplan import Run, check_runs, execute, merge_runs, plan_block_copy, plan_tensor_copy, split_runs
from .errors import (
    InvalidRange,
    OutOfPoolMemory,
    ProcessGone,
    SegmentNotFound,
    SegmentTooSmall,
    SharedMemoryExhausted,
    ShmError,
)
from .mappings import MappingCache
from .names import (
    NAME_PREFIX,
    SegmentOwner,
    make_segment_name,
    owner_alive,
    parse_segment_name,
    process_start_ticks,
)
from .pool import Block, Pool
from .reaper import SHM_DIR, SegmentInfo, list_segments, reap
from .segment import PAGE_NBYTES, Segment

__all__ = [
    "NAME_PREFIX",
    "PAGE_NBYTES",
    "SHM_DIR",
    "Block",
    "InvalidRange",
    "MappingCache",
    "OutOfPoolMemory",
    "Pool",
    "ProcessGone",
    "Run",
    "Segment",
    "SegmentInfo",
    "SegmentNotFound",
    "SegmentOwner",
    "SegmentTooSmall",
    "SharedMemoryExhausted",
    "ShmError",
    "check_runs",
    "execute",
    "list_segments",
    "make_segment_name",
    "merge_runs",
    "owner_alive",
    "parse_segment_name",
    "plan_block_copy",
    "plan_tensor_copy",
    "process_start_ticks",
    "reap",
    "split_runs",
]
