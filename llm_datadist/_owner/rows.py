"""The owner's rows of its published index: which connection pins through which row, and the rows that
outlive their connection because their holder still pins through them.

Rules: a pin's lifetime belongs to its holder, the puller process: the owner never takes back a row that
pins while that process lives, whatever happened to the connection. Every method runs with the table's
lock and the index lock held (the caller's). A holder is a process (pid and start time), checked the way
the reaper checks segment owners, so a reused pid is not mistaken for it.

A row's life (who moves it):

    state      what it means                                  next
    free       nobody's; all zero                             assigned (owner, at a handshake)
    assigned   a live connection's; its holder pins (1) or    free (owner, the connection ended, row idle
               not (0) as it pulls                              or holder gone: what it reserved given back,
                                                                but for what others pulled meanwhile)
                                                              orphan (owner, the connection ended, row pins
                                                                and the holder lives)
    orphan     the connection is gone, the pin is not: the    free (owner, at housekeeping, once the holder
               holder copies on and unpins through the row      cleared the pin, or the holder is gone)
    revoked    taken back while pinned (the owner finalizes   - (the holder's unpin finds it and fails its
               and the holder outlived its wait)                transfer with LLM_LINK_FAILED)

Only the holder sets or clears a pin; only the owner assigns, orphans and frees.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_datadist._shm.errors import ProcessGone
from llm_datadist._shm.index_owner import OwnerIndex
from llm_datadist._shm.names import process_start_ticks


@dataclass(frozen=True)
class Holder:
    """The process a row was handed to (pid 0: a peer whose process we cannot see)."""

    pid: int
    start_ticks: int

    @classmethod
    def of(cls, pid: int) -> Holder:
        try:
            return cls(pid, process_start_ticks(pid))
        except ProcessGone:
            return cls(pid, -1)

    def alive(self) -> bool:
        if self.pid <= 0 or self.start_ticks < 0:
            return False
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as stat_file:
                stat = stat_file.read()
        except OSError:
            return False
        # After the command name (which may hold spaces and parentheses): state, then field 22 (starttime).
        fields = stat[stat.rindex(b")") + 2 :].split()
        # A zombie (or a dying process) keeps its pid and start time but copies nothing any more.
        return fields[0] not in (b"Z", b"X") and int(fields[19]) == self.start_ticks


class Rows:
    """The rows of one index: free, assigned to a connection, or orphaned."""

    def __init__(self, index: OwnerIndex) -> None:
        self._index = index
        self._free = list(range(index.rows - 1, -1, -1))
        self._by_conn: dict[int, int] = {}  # id(connection) -> its row
        self._holders: dict[int, Holder] = {}  # row -> the process it was handed to (assigned or orphan)
        self._orphans: set[int] = set()

    def available(self) -> bool:
        return bool(self._free)

    def assign(self, conn: object, ticket: int, incarnation: int, holder: Holder) -> int:
        """Hand a free row to `conn` (the caller checked `available`)."""
        row = self._free[-1]
        self._index.assign_row(row, ticket, incarnation)
        self._free.pop()
        self._by_conn[id(conn)] = row
        self._holders[row] = holder
        return row

    def of(self, conn: object) -> int | None:
        return self._by_conn.get(id(conn))

    def all(self) -> list[int]:
        """Every row that may pin: assigned ones and orphans."""
        return [*self._by_conn.values(), *self._orphans]

    @property
    def orphans(self) -> int:
        return len(self._orphans)

    def end(self, conn: object) -> bool:
        """`conn` ended: its row is freed (what its pin consumed given back, if its holder is gone), or
        orphaned while its live holder still pins. True if the row pinned something."""
        row = self._by_conn.pop(id(conn), None)
        if row is None:
            return False
        pinning = bool(self._index.row(row)[1])
        if pinning and self._holders[row].alive():
            self._orphans.add(row)
        else:
            self._take_back(row, give_back=pinning)
        return pinning

    def sweep(self) -> int:
        """Free the orphans whose holder let go or is gone; how many were freed."""
        freed = 0
        for row in list(self._orphans):
            pinning = bool(self._index.row(row)[1])
            if pinning and self._holders[row].alive():
                continue
            self._orphans.discard(row)
            self._take_back(row, give_back=pinning)
            freed += 1
        return freed

    def revoke_all(self) -> int:
        """Take every row back, pinned or not (the owner is closing); how many still pinned."""
        rows = self.all()
        pinned = sum(1 for row in rows if self._index.row(row)[1])
        for row in rows:
            self._take_back(row, give_back=False)
        self._by_conn.clear()
        self._orphans.clear()
        return pinned

    def _take_back(self, row: int, *, give_back: bool) -> None:
        index = self._index
        if give_back:
            entry = index.row(row)
            if entry.name >= 0 and entry.taken:
                index.restore(entry.name, entry.taken, entry.cache_slot, entry.generation)
        index.assign_row(row, 0, 0)
        index.bump_epoch()  # the table catches up: keys the pin consumed, caches only it kept
        self._holders.pop(row, None)
        self._free.append(row)
