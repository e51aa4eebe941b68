"""`cmpchat serve`: an OpenAI-compatible HTTP API over the batching engine (Starlette on uvicorn).

The engine knows nothing of HTTP; this package turns requests into engine requests and engine events
into OpenAI-shaped responses and streams.
"""
