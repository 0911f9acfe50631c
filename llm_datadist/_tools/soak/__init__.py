"""`llm-datadist soak`: `run` is the command; `driver` starts, watches and restarts the processes; `owners`
and `pullers` are those processes; `spec` is what they share; `sampler`, `figures` and `trend` measure
them; `report` prints the tables; `memdebug` is the `--debug-memory` probe.
"""
