"""The v1 "KvCacheManager mode" (the real package ships it as `llm_datadist_v1`)."""
