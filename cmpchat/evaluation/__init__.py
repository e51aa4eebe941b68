"""Quality measures for engine configurations: perplexity, divergence from a baseline, pass-key retrieval.

`cmpchat eval` is the front end. Everything here goes through the public API (`cmpchat.open_model`
and the `Model` it returns), so any engine configuration that opens as a `Model` can be measured.
"""
