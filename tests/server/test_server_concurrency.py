"""Continuous batching through the server on the tiny random model (the CPU reference backend)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from cmpchat.api import open_model
from cmpchat.chat.messages import Message
from cmpchat.engine.events import Finished
from cmpchat.engine.reply import GenerationOptions
from tests.server.live import LiveServer, metric

MAX_TOKENS = 24


def question(i: int) -> str:
    return f"Question number {i}: " + "tell me more. " * (i % 5)


@pytest.fixture(scope="module")
def alone_texts(tiny_model_path: Path) -> list[str]:
    """Each reply generated on its own by the single-sequence generator (no server, no batching)."""
    model = open_model(tiny_model_path)
    options = GenerationOptions(max_tokens=MAX_TOKENS)
    texts = []
    for i in range(16):
        *_, finished = model.chat([Message("user", question(i))], options)
        assert isinstance(finished, Finished)
        texts.append(finished.content)
    return texts


def test_sixteen_concurrent_greedy_requests_over_four_slots(tiny_server: LiveServer, alone_texts: list[str]) -> None:
    async def ask(client: openai.AsyncOpenAI, i: int) -> str:
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": question(i)}], temperature=0, max_tokens=MAX_TOKENS
        )
        return reply.choices[0].message.content or ""

    async def ask_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=tiny_server.api, api_key="x", max_retries=0, timeout=60) as client:
            return await asyncio.gather(*(ask(client, i) for i in range(16)))

    steps_before = metric(tiny_server.url, "cmpchat_decode_steps_total")
    texts = asyncio.run(ask_all())
    assert texts == alone_texts
    # Batching really happened: far fewer decode steps than sequence-steps.
    steps = metric(tiny_server.url, "cmpchat_decode_steps_total") - steps_before
    assert steps < 16 * (MAX_TOKENS - 1) / 2


def test_streamed_and_plain_requests_mix(tiny_server: LiveServer, alone_texts: list[str]) -> None:
    async def stream(client: openai.AsyncOpenAI, i: int) -> str:
        chunks = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": question(i)}],
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=tiny_server.api, api_key="x", max_retries=0, timeout=60) as client:
            return await asyncio.gather(*(stream(client, i) for i in range(8)))

    assert asyncio.run(run()) == alone_texts[:8]
