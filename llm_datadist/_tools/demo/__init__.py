"""`llm-datadist demo`: a Prompt and a Decoder process move real-sized KV cache and check every byte.
`run` is the command (the parent: it starts each pair, prints the table, reaps); `v1` and `v2` are the two
pairs of sides (kv_cache_manager, and cache_manager as vllm-ascend uses it); `common` is what they share.
"""
