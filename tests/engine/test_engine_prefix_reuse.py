"""Prefix reuse: saved states resume later prompts that extend them, with the same output as a fresh run and
without reading the reused part again; a chat's next turn reads only what is new in it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from cmpchat.api import Model, open_model
from cmpchat.chat.messages import Message
from cmpchat.engine.engine import Engine
from cmpchat.engine.events import Finished
from cmpchat.engine.prefix_cache import PrefixCache
from cmpchat.engine.reply import GenerationOptions
from cmpchat.engine.request import EngineEvent, GenerationRequest, Started
from cmpchat.model.gguf_file import ModelFile
from cmpchat.tokenizer import Tokenizer
from tests.recording_backend import Recorder
from tests.scripted_backend import ScriptedBackend, ScriptedSequence

OPTIONS = GenerationOptions(max_tokens=12)


@pytest.fixture
def tiny(tiny_model_path: Path) -> Model:
    """A fresh model each test: the engines a test makes keep saved states in its backend."""
    return open_model(tiny_model_path, sequences=3, cache_states=8)


@pytest.fixture
def scripted(tiny_model_path: Path) -> ScriptedBackend:
    model_file = ModelFile(tiny_model_path)
    return ScriptedBackend(open_model(tiny_model_path).config, Tokenizer.from_metadata(model_file.metadata))


def saved(backend: ScriptedBackend, tokens: list[int]) -> ScriptedSequence:
    sequence = backend.new_sequence()
    backend.prefill(sequence, tokens)
    return sequence


def test_lookup_finds_the_longest_saved_prefix(scripted: ScriptedBackend) -> None:
    cache = PrefixCache(scripted, capacity=4)
    cache.keep([1, 2, 3], saved(scripted, [1, 2, 3]))
    cache.keep([1, 2, 3, 4, 5], saved(scripted, [1, 2, 3, 4, 5]))
    cache.keep([9, 9], saved(scripted, [9, 9]))
    hit = cache.lookup([1, 2, 3, 4, 5, 6])
    assert hit is not None and hit.length == 5 and hit.sequence.tokens == [1, 2, 3, 4, 5]
    scripted.decode([hit.sequence], [6])  # the hit is a fork: the saved state stays as it was
    other = cache.lookup([1, 2, 3, 4, 5, 7])
    assert other is not None and other.sequence.tokens == [1, 2, 3, 4, 5]
    whole = cache.lookup([1, 2, 3, 4, 5])
    assert whole is not None and whole.length == 3  # at least one token is always left to prefill
    assert cache.lookup([1, 2, 4]) is None and cache.lookup([2, 3, 4, 5]) is None


def test_least_recently_used_states_are_evicted_and_released(scripted: ScriptedBackend) -> None:
    cache = PrefixCache(scripted, capacity=2)
    for first in (1, 2, 3):
        state = saved(scripted, [first, 0])
        cache.save([first, 0], state)
        scripted.release(state)
        if first == 2:
            hit = cache.lookup([1, 0, 5])  # touching 1 makes 2 the oldest
            assert hit is not None
            scripted.release(hit.sequence)
    assert len(cache) == 2
    assert cache.contains([1, 0]) and cache.contains([3, 0]) and not cache.contains([2, 0])
    cache.clear()
    assert scripted.held_sequences == 0 and scripted.pool.free_pages == scripted.pool.total_pages


def test_a_zero_capacity_cache_keeps_nothing(scripted: ScriptedBackend) -> None:
    cache = PrefixCache(scripted, capacity=0)
    cache.keep([1, 2], saved(scripted, [1, 2]))
    assert len(cache) == 0 and cache.lookup([1, 2, 3]) is None and scripted.held_sequences == 0


def generate(engine: Engine[Any], prompt: Sequence[int], cache_points: Sequence[int] = ()) -> tuple[Started, Finished]:
    events: list[EngineEvent] = []
    engine.submit(GenerationRequest(tuple(prompt), OPTIONS, cache_points=tuple(cache_points)), events.extend)
    engine.run_until_idle()
    started, finished = events[0], events[-1]
    assert isinstance(started, Started) and isinstance(finished, Finished)
    return started, finished


def fresh(model: Model, prompt: Sequence[int]) -> Finished:
    return generate(Engine(model.backend, model.tokenizer, slots=1, cache_states=0), prompt)[1]


def first_started(events: Sequence[EngineEvent]) -> Started:
    assert isinstance(events[0], Started)
    return events[0]


def last_finished(events: Sequence[EngineEvent]) -> Finished:
    assert isinstance(events[-1], Finished)
    return events[-1]


def test_a_chat_turn_reads_only_what_is_new_in_it(tiny: Model) -> None:
    backend = Recorder(tiny.backend)
    model = Model(tiny.model_file, backend, slots=1)
    first_turn = [Message("user", "Hello, how are you?")]
    first = last_finished(list(model.chat(first_turn, OPTIONS)))
    second_turn = [*first_turn, Message("assistant", first.content), Message("user", "Tell me more.")]
    request = model.chat_request(second_turn, OPTIONS)
    (point,) = model.next_turn_point(first_turn, model.chat_request(first_turn).prompt)
    assert request.prompt[:point] == model.chat_request(first_turn).prompt[:point]

    before = backend.prefilled_tokens
    second = last_finished(list(model.chat(second_turn, OPTIONS)))
    assert backend.prefilled_tokens - before == len(request.prompt) - point == second.timings.prompt_tokens
    assert (second.content, second.reason) == (fresh(tiny, request.prompt).content, fresh(tiny, request.prompt).reason)


def test_the_next_request_resumes_from_the_state_a_reply_ended_in(scripted: ScriptedBackend) -> None:
    tokenizer = scripted.tokenizer
    engine = Engine(scripted, tokenizer, slots=1)
    prompt = tokenizer.encode("SAY:hello world")
    _, first = generate(engine, prompt)
    assert (first.content, first.reason) == ("hello world", "stop")
    # The reply's sequence read the prompt, the reply and its end token: a prompt that repeats all of it
    # (as a chat template renders the conversation so far) resumes there.
    read = [*prompt, *tokenizer.encode("hello world"), scripted.end_token]
    before = scripted.prefilled_tokens
    started, _ = generate(engine, read + tokenizer.encode("\nSAY:again"))
    assert started.cached_tokens == len(read)
    assert scripted.prefilled_tokens - before == len(tokenizer.encode("\nSAY:again"))


def test_a_shared_long_prefix_is_reused_at_its_last_chunk_boundary(tiny: Model) -> None:
    backend = Recorder(tiny.backend)
    engine = Engine(backend, tiny.tokenizer, slots=1, prefill_chunk=32, cache_states=8)
    system = "You are a helpful assistant who answers in full sentences. " * 3
    one = tiny.tokenize(system + "First question?")
    two = tiny.tokenize(system + "A different question!")
    shared = next(i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a != b)
    generate(engine, one)
    started, reused = generate(engine, two)
    assert started.cached_tokens == (len(one) - 1) // 32 * 32 <= shared
    assert started.cached_tokens > 0
    assert reused.content == fresh(tiny, two).content


def test_concurrent_requests_sharing_a_prefix_all_match_fresh_runs(tiny: Model) -> None:
    conversations = [
        [Message("user", "A shared opening line for everyone."), Message("assistant", "ok"), Message("user", f"Q {i}?")]
        for i in range(6)
    ]
    requests = [tiny.chat_request(c, OPTIONS) for c in conversations]
    engine = Engine(tiny.backend, tiny.tokenizer, slots=3, prefill_chunk=16, cache_states=8)
    results: dict[int, list[EngineEvent]] = {}
    for i, request in enumerate(requests):
        results[i] = []
        engine.submit(request, results[i].extend)
    engine.run_until_idle()
    assert sum(first_started(events).cached_tokens for events in results.values()) > 0
    for i, request in enumerate(requests):
        assert last_finished(results[i]).content == fresh(tiny, request.prompt).content
    engine.prefix_cache.clear()
    assert tiny.backend.held_sequences == 0
