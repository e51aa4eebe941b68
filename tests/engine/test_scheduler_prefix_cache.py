"""Prefix reuse: saved sequence states resume later prompts that extend them, with the same output as a
fresh run and without prefilling the reused part again."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmpchat.api import Model, open_model
from cmpchat.chat.messages import Message
from cmpchat.engine.batch import BatchEngine
from cmpchat.engine.events import Finished
from cmpchat.engine.generator import GenerationOptions
from cmpchat.engine.prefix_cache import PrefixCache
from cmpchat.engine.request import GenerationRequest, Started
from cmpchat.model.gguf_file import ModelFile
from cmpchat.tokenizer import Tokenizer
from tests.server.recording import Recorder
from tests.server.scripted import ScriptedBackend

OPTIONS = GenerationOptions(max_tokens=12)


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> Model:
    return open_model(tiny_model_path)


@pytest.fixture
def scripted(tiny_model_path: Path) -> ScriptedBackend:
    model_file = ModelFile(tiny_model_path)
    return ScriptedBackend(open_model(tiny_model_path).config, Tokenizer.from_metadata(model_file.metadata))


def saved(backend: ScriptedBackend, tokens: list[int]):
    sequence = backend.new_sequence()
    backend.prefill(sequence, tokens)
    return sequence


def test_lookup_finds_the_longest_saved_prefix(scripted: ScriptedBackend) -> None:
    cache = PrefixCache(scripted, capacity=4)
    cache.save([1, 2, 3], saved(scripted, [1, 2, 3]))
    cache.save([1, 2, 3, 4, 5], saved(scripted, [1, 2, 3, 4, 5]))
    cache.save([9, 9], saved(scripted, [9, 9]))
    hit = cache.lookup([1, 2, 3, 4, 5, 6])
    assert hit is not None and hit.length == 5 and hit.sequence["tokens"] == [1, 2, 3, 4, 5]
    hit.sequence["tokens"].append(6)  # the hit is a copy: the saved state stays as it was
    assert cache.lookup([1, 2, 3, 4, 5, 7]).sequence["tokens"] == [1, 2, 3, 4, 5]
    assert cache.lookup([1, 2, 3, 4, 5]).length == 3  # at least one token is always left to prefill
    assert cache.lookup([1, 2, 4]) is None and cache.lookup([2, 3, 4, 5]) is None


def test_least_recently_used_states_are_evicted_and_released(scripted: ScriptedBackend) -> None:
    cache = PrefixCache(scripted, capacity=2)
    for first in (1, 2, 3):
        state = saved(scripted, [first, 0])
        cache.save([first, 0], state)
        scripted.release(state)
        if first == 2:
            assert cache.lookup([1, 0, 5]) is not None  # touching 1 makes 2 the oldest
    assert len(cache) == 2
    assert cache.contains([1, 0]) and cache.contains([3, 0]) and not cache.contains([2, 0])
    live_copies = scripted.live_sequences
    cache.clear()
    assert scripted.live_sequences == live_copies - 2


def test_a_zero_capacity_cache_keeps_nothing(scripted: ScriptedBackend) -> None:
    cache = PrefixCache(scripted, capacity=0)
    cache.save([1, 2], saved(scripted, [1, 2]))
    assert len(cache) == 0 and cache.lookup([1, 2, 3]) is None


def conversation(model: Model, turns: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Prompt tokens of a conversation, and its cache point (where the generation prompt starts)."""
    messages = [Message("user" if i % 2 == 0 else "assistant", text) for i, text in enumerate(turns)]
    prompt = model.tokenize(model.render(messages).text, parse_special=True)
    history = model.tokenize(model.chat_format.render(messages, add_generation_prompt=False).text, parse_special=True)
    assert prompt[: len(history)] == history
    return tuple(prompt), (len(history),)


def generate(engine: BatchEngine, prompt, cache_points=()) -> tuple[Started, Finished]:
    events: list = []
    engine.submit(GenerationRequest(prompt, OPTIONS, cache_points=cache_points), events.extend)
    engine.run_until_idle()
    return events[0], events[-1]


def test_a_follow_up_turn_resumes_from_the_saved_state(tiny: Model) -> None:
    backend = Recorder(tiny.backend)
    engine = BatchEngine(backend, tiny.tokenizer, prefill_chunk=64, cache_entries=8)
    first_prompt, first_points = conversation(tiny, ["Hello, how are you?"])
    _, first = generate(engine, first_prompt, first_points)
    follow_up, points = conversation(tiny, ["Hello, how are you?", first.content, "Tell me more."])

    prefilled_before = backend.prefilled_tokens
    started, resumed = generate(engine, follow_up, points)
    prefilled = backend.prefilled_tokens - prefilled_before

    assert started.cached_tokens == first_points[0]
    assert prefilled == len(follow_up) - first_points[0]
    assert resumed.timings.prompt_tokens == prefilled
    fresh_engine = BatchEngine(tiny.backend, tiny.tokenizer, prefill_chunk=64, cache_entries=0)
    _, fresh = generate(fresh_engine, follow_up)
    assert (resumed.content, resumed.reason) == (fresh.content, fresh.reason)


def test_a_shared_long_prefix_is_reused_at_chunk_boundaries(tiny: Model) -> None:
    backend = Recorder(tiny.backend)
    engine = BatchEngine(backend, tiny.tokenizer, prefill_chunk=32, cache_entries=8)
    system = "You are a helpful assistant who answers in full sentences. " * 3
    one = tuple(tiny.tokenize(system + "First question?"))
    two = tuple(tiny.tokenize(system + "A different question!"))
    shared = next(i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a != b)
    generate(engine, one)
    started, reused = generate(engine, two)
    assert started.cached_tokens == shared // 32 * 32 > 0
    _, fresh = generate(BatchEngine(tiny.backend, tiny.tokenizer, prefill_chunk=32, cache_entries=0), two)
    assert reused.content == fresh.content


def test_concurrent_requests_sharing_a_prefix_all_match_fresh_runs(tiny: Model) -> None:
    prompts = [conversation(tiny, ["A shared opening line for everyone.", "ok", f"Question {i}?"]) for i in range(6)]
    engine = BatchEngine(tiny.backend, tiny.tokenizer, slots=3, prefill_chunk=16, cache_entries=4)
    results: dict[int, list] = {}
    for i, (prompt, points) in enumerate(prompts):
        results[i] = []
        engine.submit(GenerationRequest(prompt, OPTIONS, cache_points=points), results[i].extend)
    engine.run_until_idle()
    assert sum(events[0].cached_tokens for events in results.values()) > 0
    fresh = BatchEngine(tiny.backend, tiny.tokenizer, prefill_chunk=16, cache_entries=0)
    for i, (prompt, _) in enumerate(prompts):
        assert results[i][-1].content == generate(fresh, prompt)[1].content
