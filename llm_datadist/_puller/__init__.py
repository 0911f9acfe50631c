"""The puller's side: what this process reads from, and writes into, its peers' memory.

Reading order: `source` (what a transfer names at the peer, and where the peer says that is), `peer` (the
puller's side of one link: the wire's link, the mover chosen for it, what was learnt and mapped over it),
`links` (our links and the links back, as peers), `dataplane` (pins through our row of a peer's published
index) and `acquire` (every pin and lease begun and ended in one place), `movers` (how bytes move: `copy`
and `vm` on this host, `crosshost` with `peer_engine` and `remote` to other hosts), then the transfers:
`transfers` (v1 pulls and pushes, v2 transfers that pin), `fresh` (a pull of a key in one call of the C
kernel), `oneside` (v2 reads with no message to the peer), `pushplan` (`transfer_cache_async`'s plans)
and `local` (copies inside this process). Nothing here imports the node (`_core`, `_comm`, `_hixl`) or
the faces.
"""
