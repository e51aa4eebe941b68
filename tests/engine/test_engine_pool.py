"""The shared KV pool under pressure, on the reference backend: requests that outgrow the pool are preempted
and resumed and still say exactly what they say alone; a long prompt waits for room and then runs; a prompt
larger than the whole pool is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.engine.engine import Engine
from cmpchat.engine.events import Finished
from cmpchat.engine.reply import GenerationOptions
from cmpchat.engine.request import GenerationRequest
from cmpchat.errors import CmpchatError
from cmpchat.model.gguf_file import ModelFile
from cmpchat.tokenizer import Tokenizer

PAGE = 16


@pytest.fixture(scope="module")
def model_file(tiny_model_path: Path) -> ModelFile:
    return ModelFile(tiny_model_path)


def engine_with_pool(model_file: ModelFile, pool_tokens: int, slots: int = 16) -> Engine:
    backend = ReferenceBackend(model_file, page_tokens=PAGE, pool_tokens=pool_tokens, max_sequences=slots + 2)
    return Engine(backend, Tokenizer.from_metadata(model_file.metadata), slots=slots, prefill_chunk=64, cache_states=0)


def prompts(tokenizer: Tokenizer, count: int) -> list[tuple[int, ...]]:
    return [tuple(tokenizer.encode(f"request {i}: " + "words " * (i % 5))) for i in range(count)]


def run(engine: Engine, requests: list[GenerationRequest]) -> list[Finished]:
    events: list[list] = [[] for _ in requests]
    for request, sink in zip(requests, events, strict=True):
        engine.submit(request, sink.extend)
    engine.run_until_idle()
    finished = [sink[-1] for sink in events]
    assert all(isinstance(f, Finished) for f in finished), [sink[-1] for sink in events]
    return finished


def alone(model_file: ModelFile, request: GenerationRequest) -> Finished:
    return run(engine_with_pool(model_file, pool_tokens=4096, slots=1), [request])[0]


def test_growing_requests_are_preempted_and_resumed_and_say_what_they_say_alone(model_file: ModelFile) -> None:
    tokenizer = Tokenizer.from_metadata(model_file.metadata)
    options = GenerationOptions(max_tokens=40, ignore_eos=True)
    requests = [GenerationRequest(p, options) for p in prompts(tokenizer, 16)]
    # 16 requests of ~20-30 prompt tokens growing by 40 each need ~60 pages of 16 tokens; the pool has 24.
    engine = engine_with_pool(model_file, pool_tokens=24 * PAGE)
    together = run(engine, requests)
    assert engine.stats.preemptions > 0
    for request, got in zip(requests, together, strict=True):
        want = alone(model_file, request)
        assert (got.content, got.reason, got.timings.generated_tokens) == (want.content, "length", 40)
    backend = engine.backend
    assert backend.held_sequences == 0 and backend.pool.free_pages == backend.pool.total_pages


def test_a_long_prompt_waits_for_room_beside_short_requests_and_completes(model_file: ModelFile) -> None:
    tokenizer = Tokenizer.from_metadata(model_file.metadata)
    engine = engine_with_pool(model_file, pool_tokens=40 * PAGE)
    short = [GenerationRequest(p, GenerationOptions(max_tokens=30, ignore_eos=True)) for p in prompts(tokenizer, 15)]
    long = GenerationRequest(tuple(tokenizer.encode("a long document " * 28))[:420], GenerationOptions(max_tokens=8))
    finished = run(engine, [*short, long])
    assert finished[-1].reason in ("length", "stop") and finished[-1].timings.prompt_tokens >= 420
    assert finished[-1].content == alone(model_file, long).content


def test_a_prompt_larger_than_the_pool_is_refused_in_one_line(model_file: ModelFile) -> None:
    engine = engine_with_pool(model_file, pool_tokens=8 * PAGE)
    with pytest.raises(CmpchatError) as refusal:
        engine.submit(GenerationRequest((65,) * (8 * PAGE), GenerationOptions()), lambda events: None)
    message = str(refusal.value)
    assert "\n" not in message
    assert f"{8 * PAGE} tokens ({9} KV pages of {PAGE})" in message and f"holds {8 * PAGE} tokens (8 pages)" in message
