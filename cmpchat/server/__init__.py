"""`cmpchat serve`: an OpenAI-compatible HTTP API over the batching engine (Starlette on uvicorn), with OpenAI's
Responses API and Anthropic's Messages API beside chat and completions.

The engine knows nothing of HTTP; this package turns requests into engine requests and engine events into each
API's responses and streams (`generation` serves one; `blocks` is the reply structure both newer APIs stream).
"""
