"""The v2 ("cache manager") generation of the API (real path: `llm_datadist.v2`); the public names are
re-exported by `llm_datadist` itself, so this package init stays empty."""
