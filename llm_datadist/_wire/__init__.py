"""The wire: sockets and threads that move frames between linked processes, and nothing else (it never
knows what a cache is; the server is handed a `Service` to answer requests).

Reading order: `peer` (who is at the other end, the `Service` the server hands requests to), `server` (one
selector thread per process) with its parts `conn` (one accepted connection, its buffered output),
`door` (handshakes, admission, refusals; `auth` and `admission` are its rules) and `listeners`; then
`client` (the puller's end of a link).
"""
