"""The tools around the library: the `llm-datadist` command (`cli`), its `demo` and `soak`, the network
namespaces that make two "hosts" on one machine (`netns`), and the byte patterns they fill caches with.

Rules: the tools use the library as a user would (its public API, and private modules only where they
measure or clean up internals), by absolute name; each other relatively. Nothing else in llm_datadist
imports them (tests/test_layering.py); bench (llm_datadist._bench) may.
"""
