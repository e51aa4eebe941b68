"""The engine driven step by step over several requests: batched output equals each request alone, chunked
prefill interleaves with decoding, the queue is bounded, cancellation and failures free their sequences."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from cmpchat.api import Model, open_model
from cmpchat.backends.base import HostLogits
from cmpchat.engine.engine import Engine
from cmpchat.engine.events import ContentDelta, Finished, PromptProgress
from cmpchat.engine.reply import GenerationOptions
from cmpchat.engine.request import Failed, GenerationRequest, QueueFull, Started
from cmpchat.model.gguf_file import ModelFile
from cmpchat.sampling import SamplingParams
from cmpchat.tokenizer import Tokenizer
from tests.recording_backend import Recorder
from tests.scripted_backend import FOREVER, ScriptedBackend


class Collector:
    """An event sink per request, keeping everything it was sent."""

    def __init__(self) -> None:
        self.events: dict[int, list] = {}

    def sink(self, key: int):
        self.events[key] = []
        return self.events[key].extend

    def finished(self, key: int) -> Finished:
        last = self.events[key][-1]
        assert isinstance(last, Finished), last
        return last


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> Model:
    return open_model(tiny_model_path, sequences=4, cache_states=0)


def prompts(model: Model, count: int) -> list[tuple[int, ...]]:
    texts = [
        f"<|im_start|>user\nnumber {i} " + "more words " * (i % 6) + "<|im_end|>\n<|im_start|>assistant\n"
        for i in range(count)
    ]
    return [tuple(model.tokenize(text, parse_special=True)) for text in texts]


def run_all(engine: Engine, requests: Sequence[GenerationRequest]) -> Collector:
    collector = Collector()
    for i, request in enumerate(requests):
        engine.submit(request, collector.sink(i))
    engine.run_until_idle()
    return collector


def alone(model: Model, request: GenerationRequest) -> Finished:
    """The request on a fresh engine of its own, nothing else running and nothing saved."""
    engine = Engine(model.backend, model.tokenizer, slots=1, cache_states=0)
    return run_all(engine, [request]).finished(0)


def test_batched_greedy_output_equals_single_sequence_output(tiny: Model) -> None:
    options = GenerationOptions(max_tokens=16)
    requests = [GenerationRequest(p, options) for p in prompts(tiny, 10)]
    expected = [alone(tiny, r) for r in requests]
    engine = Engine(tiny.backend, tiny.tokenizer, slots=4, prefill_chunk=8, cache_states=0)
    collector = run_all(engine, requests)
    for i, want in enumerate(expected):
        got = collector.finished(i)
        assert (got.content, got.reason, got.timings.generated_tokens) == (
            want.content,
            want.reason,
            want.timings.generated_tokens,
        )
    assert engine.stats.decode_tokens > engine.stats.decode_steps  # steps really were batched


class StepBufferBackend(Recorder):
    """The CUDA backend's contract over the reference backend: logits are handles to rows of one step buffer
    that the next prefill or decode overwrites; only `select` and `to_host` read them."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.rows = np.zeros((16, inner.config.vocab_size), np.float32)

    def _store(self, logits) -> HostLogits:
        values = self.inner.to_host(logits)
        self.rows[: len(values)] = values
        self.rows[len(values) :] = np.nan
        return HostLogits(self.rows[: len(values)])  # a view: the next step overwrites it

    def prefill(self, sequence, tokens, *, positions=None):
        return self._store(super().prefill(sequence, tokens, positions=positions))

    def decode(self, sequences, tokens, *, group=0):
        return self._store(super().decode(sequences, tokens, group=group))


@pytest.mark.parametrize("spread", [True, False])
def test_decode_groups_give_each_request_what_it_gets_alone(tiny: Model, spread: bool) -> None:
    """Three decode groups (a pipeline of three stages keeps a step of each in flight): the requests spread over
    them (stages on separate GPUs) or fill one before the next (stages sharing one GPU: 2 rows a step here)."""
    options = GenerationOptions(max_tokens=12)
    requests = [GenerationRequest(p, options) for p in prompts(tiny, 7)]
    expected = [alone(tiny, r).content for r in requests]
    backend = Recorder(tiny.backend)
    backend.decode_groups, backend.spread_decode_groups, backend.max_batch = 3, spread, 2
    engine = Engine(backend, tiny.tokenizer, slots=4, prefill_chunk=256, cache_states=0)  # 4 prompts a step
    collector = run_all(engine, requests)
    assert [collector.finished(i).content for i in range(len(requests))] == expected
    rows = [len(ids) for kind, ids in backend.calls if kind == "decode"]
    assert max(rows) == 2 and set(backend.groups) == ({0, 1, 2} if spread else {0, 1})


def test_logits_are_selected_before_the_next_step_overwrites_them(tiny: Model) -> None:
    options = GenerationOptions(max_tokens=12)
    requests = [GenerationRequest(p, options) for p in prompts(tiny, 8)]
    expected = [alone(tiny, r).content for r in requests]
    engine = Engine(StepBufferBackend(tiny.backend), tiny.tokenizer, slots=4, prefill_chunk=8, cache_states=0)
    collector = run_all(engine, requests)
    assert [collector.finished(i).content for i in range(len(requests))] == expected


def test_seeded_sampling_in_a_batch_equals_sampling_alone(tiny: Model) -> None:
    requests = [
        GenerationRequest(
            p, GenerationOptions(max_tokens=12, sampling=SamplingParams(temperature=1.0, top_k=50, seed=i))
        )
        for i, p in enumerate(prompts(tiny, 6))
    ]
    expected = [alone(tiny, r).content for r in requests]
    collector = run_all(Engine(tiny.backend, tiny.tokenizer, slots=3, cache_states=0), requests)
    assert [collector.finished(i).content for i in range(6)] == expected


def test_events_come_in_order(tiny: Model) -> None:
    request = GenerationRequest(prompts(tiny, 1)[0], GenerationOptions(max_tokens=5))
    collector = run_all(Engine(tiny.backend, tiny.tokenizer, prefill_chunk=4, cache_states=0), [request])
    events = collector.events[0]
    assert isinstance(events[0], Started) and events[0].cached_tokens == 0
    progress = [e for e in events if isinstance(e, PromptProgress)]
    assert [p.done for p in progress] == list(range(4, progress[-1].total, 4)) + [progress[-1].total]
    assert isinstance(events[-1], Finished) and sum(isinstance(e, Finished) for e in events) == 1
    assert events[-1].timings.prompt_tokens == progress[-1].total


def test_a_long_prompt_is_prefilled_between_decode_steps(tiny: Model) -> None:
    backend = Recorder(tiny.backend)
    engine = Engine(backend, tiny.tokenizer, slots=2, prefill_chunk=16, cache_states=0)
    short, long = prompts(tiny, 1)[0], tuple(tiny.tokenize("many words " * 30))
    collector = Collector()
    engine.submit(GenerationRequest(short, GenerationOptions(max_tokens=60)), collector.sink(0))
    engine.step()
    engine.step()  # the short request is decoding now
    engine.submit(GenerationRequest(long, GenerationOptions(max_tokens=2)), collector.sink(1))
    engine.run_until_idle()
    short_sequence = backend.calls[0][1][0]
    long_chunks = [i for i, (kind, arg) in enumerate(backend.calls) if kind == "prefill" and arg[0] != short_sequence]
    assert len(long_chunks) == -(-len(long) // 16)
    assert all(arg[1] <= 16 for kind, arg in backend.calls if kind == "prefill")
    # Between two chunks of the long prompt the short request takes a decode step.
    for before, after in zip(long_chunks, long_chunks[1:]):
        between = backend.calls[before + 1 : after]
        assert any(kind == "decode" and short_sequence in arg for kind, arg in between)
    assert collector.finished(0).reason == "length" and collector.finished(1).reason == "length"


def scripted_engine(path: Path, **kwargs) -> tuple[Engine, ScriptedBackend, Tokenizer]:
    model_file = ModelFile(path)
    tokenizer = Tokenizer.from_metadata(model_file.metadata)
    backend = ScriptedBackend(open_model(path).config, tokenizer)
    return Engine(backend, tokenizer, **kwargs), backend, tokenizer


def test_the_waiting_queue_is_bounded(tiny_model_path: Path) -> None:
    engine, _, tokenizer = scripted_engine(tiny_model_path, slots=1, max_waiting=1)
    request = GenerationRequest(tuple(tokenizer.encode("SAY:hi")), GenerationOptions())
    engine.submit(request, lambda events: None)
    engine.submit(request, lambda events: None)
    with pytest.raises(QueueFull, match="busy"):
        engine.submit(request, lambda events: None)
    engine.run_until_idle()
    engine.submit(request, lambda events: None)  # room again


def test_cancelling_frees_slots_and_sequences(tiny_model_path: Path) -> None:
    engine, backend, tokenizer = scripted_engine(tiny_model_path, slots=1, cache_states=0)
    endless = GenerationRequest(tuple(tokenizer.encode("SAY:abc" + FOREVER)), GenerationOptions(max_tokens=1000))
    collector = Collector()
    running = engine.submit(endless, collector.sink(0))
    waiting = engine.submit(endless, collector.sink(1))
    for _ in range(5):
        engine.step()
    assert engine.running == 1 and engine.waiting == 1
    waiting.cancel()
    running.cancel()
    engine.run_until_idle()
    assert collector.finished(0).reason == "cancelled" and collector.finished(0).content.startswith("abc")
    assert collector.finished(1).reason == "cancelled" and not any(isinstance(e, Started) for e in collector.events[1])
    assert backend.held_sequences == 0 and backend.pool.free_pages == backend.pool.total_pages
    assert engine.stats.finished["cancelled"] == 2


def test_a_failing_backend_fails_that_batch_only(tiny: Model) -> None:
    backend = Recorder(tiny.backend, fail_decode_at=3)
    engine = Engine(backend, tiny.tokenizer, slots=2, cache_states=0)
    requests = [GenerationRequest(p, GenerationOptions(max_tokens=8)) for p in prompts(tiny, 3)]
    collector = run_all(engine, requests)
    failed = [i for i in range(3) if isinstance(collector.events[i][-1], Failed)]
    assert failed == [0, 1]
    assert "device lost" in collector.events[0][-1].message
    assert collector.finished(2).timings.generated_tokens == 8
    assert engine.running == 0 and engine.stats.failed == 2
    assert tiny.backend.held_sequences == 0


def test_the_engine_thread_serves_and_stops(tiny_model_path: Path) -> None:
    engine, backend, tokenizer = scripted_engine(tiny_model_path, slots=2)
    backend.step_delay = 0.002  # the endless request below is still running when the engine stops
    engine.start()
    done = threading.Event()
    texts: list[str] = []

    def sink(events) -> None:
        for event in events:
            if isinstance(event, ContentDelta):
                texts.append(event.text)
            if isinstance(event, Finished):
                done.set()

    engine.submit(GenerationRequest(tuple(tokenizer.encode("SAY:threaded")), GenerationOptions()), sink)
    assert done.wait(10)
    assert "".join(texts) == "threaded"
    left = Collector()
    engine.submit(GenerationRequest(tuple(tokenizer.encode("SAY:x" + FOREVER)), GenerationOptions()), left.sink(0))
    time.sleep(0.05)
    engine.stop()
    assert left.finished(0).reason == "cancelled"


def test_generate_from_several_threads_without_an_engine_thread(tiny_model_path: Path) -> None:
    engine, backend, tokenizer = scripted_engine(tiny_model_path, slots=2)
    results: dict[int, str] = {}

    def reply(i: int) -> None:
        request = GenerationRequest(tuple(tokenizer.encode(f"SAY:thread {i}")), GenerationOptions())
        results[i] = next(e for e in engine.generate(request) if isinstance(e, Finished)).content

    threads = [threading.Thread(target=reply, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert results == {i: f"thread {i}" for i in range(4)}
