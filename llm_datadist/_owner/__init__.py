"""The owner's side: the caches this process serves and everything peers hold on them.

Reading order: `records` (what is recorded), `table` (caches and keys, what the owner's own calls do),
`mirror` (the published index pullers on this host read and pin in), `rows` (a row's life), `pins` (this
process's own transfers' hold on its caches), `leases` (what peers hold by message, and their
connections' rows), `service` (requests read off a connection become calls here). The server
(`_wire`) is handed a `CacheService` and never sees a table.
"""
