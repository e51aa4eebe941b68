"""The batching engine driven step by step: batched output equals single-sequence output, chunked
prefill interleaves with decoding, the queue is bounded, cancellation and failures free their slots."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cmpchat.api import Model, open_model
from cmpchat.backends.base import Backend
from cmpchat.engine.batch import BatchEngine
from cmpchat.engine.events import ContentDelta, Finished, PromptProgress
from cmpchat.engine.generator import GenerationOptions
from cmpchat.engine.request import Failed, GenerationRequest, QueueFull, Started
from cmpchat.model.gguf_file import ModelFile
from cmpchat.sampling import SamplingParams
from cmpchat.tokenizer import Tokenizer
from tests.server.recording import Recorder
from tests.server.scripted import FOREVER, ScriptedBackend


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
    return open_model(tiny_model_path)


def prompts(model: Model, count: int) -> list[tuple[int, ...]]:
    texts = [
        f"<|im_start|>user\nnumber {i} " + "more words " * (i % 6) + "<|im_end|>\n<|im_start|>assistant\n"
        for i in range(count)
    ]
    return [tuple(model.tokenize(text, parse_special=True)) for text in texts]


def run_all(engine: BatchEngine, requests: Sequence[GenerationRequest]) -> Collector:
    collector = Collector()
    for i, request in enumerate(requests):
        engine.submit(request, collector.sink(i))
    engine.run_until_idle()
    return collector


def test_batched_greedy_output_equals_single_sequence_output(tiny: Model) -> None:
    options = GenerationOptions(max_tokens=16, prefill_chunk=8)
    requests = [GenerationRequest(p, options) for p in prompts(tiny, 10)]
    alone = [list(tiny.generator.generate(list(r.prompt), options))[-1] for r in requests]
    engine = BatchEngine(tiny.backend, tiny.tokenizer, slots=4, prefill_chunk=8, cache_entries=0)
    collector = run_all(engine, requests)
    for i, expected in enumerate(alone):
        got = collector.finished(i)
        assert (got.content, got.reason, got.timings.generated_tokens) == (
            expected.content,
            expected.reason,
            expected.timings.generated_tokens,
        )
    assert engine.stats.decode_tokens > engine.stats.decode_steps  # steps really were batched


@dataclass(frozen=True)
class StepRows:
    """Rows of `StepBufferBackend`'s buffer: a handle, like the CUDA backend's logits."""

    start: int
    count: int


class StepBufferBackend(Backend):
    """The CUDA backend's contract over the reference backend: logits are handles to rows of one step
    buffer that the next prefill or decode overwrites (a prompt chunk's last row sits at its length - 1);
    only `sample` and `to_host` read them."""

    name = "step-buffer"

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.config = inner.config
        self.rows = np.zeros((16, inner.config.vocab_size), np.float32)

    def new_sequence(self):
        return self.inner.new_sequence()

    def copy_sequence(self, sequence):
        return self.inner.copy_sequence(sequence)

    def sequence_length(self, sequence) -> int:
        return self.inner.sequence_length(sequence)

    def release(self, sequence) -> None:
        self.inner.release(sequence)

    def prefill(self, sequence, tokens, *, positions=None, all_logits=False):
        last = min(len(tokens), len(self.rows)) - 1
        self.rows[last] = self.inner.prefill(sequence, tokens)
        return StepRows(last, 1)

    def decode(self, sequences, tokens):
        self.rows[: len(sequences)] = self.inner.decode(sequences, tokens)
        return StepRows(0, len(sequences))

    def to_host(self, logits):
        return self.rows[logits.start : logits.start + logits.count].copy()


def test_logits_are_sampled_before_the_next_step_overwrites_them(tiny: Model) -> None:
    options = GenerationOptions(max_tokens=12, prefill_chunk=8)
    requests = [GenerationRequest(p, options) for p in prompts(tiny, 8)]
    alone = [list(tiny.generator.generate(list(r.prompt), options))[-1].content for r in requests]
    engine = BatchEngine(StepBufferBackend(tiny.backend), tiny.tokenizer, slots=4, prefill_chunk=8, cache_entries=0)
    collector = run_all(engine, requests)
    assert [collector.finished(i).content for i in range(len(requests))] == alone


class WaitingBackend(StepBufferBackend):
    """As a GPU backend: the wait for a step ends when its tokens are sampled."""

    def sample(self, logits, params, histories, rngs):
        time.sleep(0.01)
        return super().sample(logits, params, histories, rngs)


def test_decode_time_runs_until_the_tokens_are_back(tiny: Model) -> None:
    requests = [GenerationRequest(p, GenerationOptions(max_tokens=6)) for p in prompts(tiny, 3)]
    engine = BatchEngine(WaitingBackend(tiny.backend), tiny.tokenizer, slots=4, cache_entries=0)
    run_all(engine, requests)
    assert engine.stats.decode_steps > 0
    assert engine.stats.decode_seconds >= 0.01 * engine.stats.decode_steps


@pytest.mark.gpu
def test_the_engine_serves_from_the_gpu_backend(tiny_model_path: Path) -> None:
    model = open_model(tiny_model_path, backend="cuda", sequences=4, context=4096)
    options = GenerationOptions(max_tokens=12, prefill_chunk=8)
    requests = [GenerationRequest(p, options) for p in prompts(model, 6)]
    first_tokens = [list(model.generator.generate(list(r.prompt), options))[-1].content[:1] for r in requests]
    engine = BatchEngine(model.backend, model.tokenizer, slots=4, prefill_chunk=8, cache_entries=0)
    collector = run_all(engine, requests)
    for i in range(len(requests)):
        assert not any(isinstance(event, Failed) for event in collector.events[i])
        finished = collector.finished(i)
        assert finished.reason in ("length", "stop") and finished.timings.generated_tokens >= 1
        assert finished.content[:1] == first_tokens[i]  # both chose from the prompt's last logits
    assert engine.stats.decode_tokens > engine.stats.decode_steps


def test_seeded_sampling_in_a_batch_equals_sampling_alone(tiny: Model) -> None:
    requests = [
        GenerationRequest(
            p, GenerationOptions(max_tokens=12, sampling=SamplingParams(temperature=1.0, top_k=50, seed=i))
        )
        for i, p in enumerate(prompts(tiny, 6))
    ]
    alone = [list(tiny.generator.generate(list(r.prompt), r.options))[-1].content for r in requests]
    collector = run_all(BatchEngine(tiny.backend, tiny.tokenizer, slots=3), requests)
    assert [collector.finished(i).content for i in range(6)] == alone


def test_events_come_in_order(tiny: Model) -> None:
    request = GenerationRequest(prompts(tiny, 1)[0], GenerationOptions(max_tokens=5))
    collector = run_all(BatchEngine(tiny.backend, tiny.tokenizer, prefill_chunk=4), [request])
    events = collector.events[0]
    assert isinstance(events[0], Started) and events[0].cached_tokens == 0
    progress = [e for e in events if isinstance(e, PromptProgress)]
    assert [p.done for p in progress] == list(range(4, progress[-1].total, 4)) + [progress[-1].total]
    assert isinstance(events[-1], Finished) and sum(isinstance(e, Finished) for e in events) == 1
    assert events[-1].timings.prompt_tokens == progress[-1].total


def test_a_long_prompt_is_prefilled_between_decode_steps(tiny: Model) -> None:
    backend = Recorder(tiny.backend)
    engine = BatchEngine(backend, tiny.tokenizer, slots=2, prefill_chunk=16, cache_entries=0)
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
    # Every chunk of the long prompt is followed by a decode step of the short request.
    for index in long_chunks:
        assert backend.calls[index + 1][0] == "decode" and short_sequence in backend.calls[index + 1][1]
    assert collector.finished(0).reason == "length" and collector.finished(1).reason == "length"


def test_the_waiting_queue_is_bounded(tiny_model_path: Path) -> None:
    engine, model = scripted_engine(tiny_model_path, slots=1, max_waiting=1)
    request = GenerationRequest(tuple(model.tokenize("SAY:hi")), GenerationOptions())
    engine.submit(request, lambda events: None)
    engine.submit(request, lambda events: None)
    with pytest.raises(QueueFull, match="busy"):
        engine.submit(request, lambda events: None)
    engine.run_until_idle()
    engine.submit(request, lambda events: None)  # room again


def scripted_engine(path: Path, **kwargs) -> tuple[BatchEngine, Model]:
    model_file = ModelFile(path)
    tokenizer = Tokenizer.from_metadata(model_file.metadata)
    model = Model(model_file, ScriptedBackend(open_model(path).config, tokenizer))
    return BatchEngine(model.backend, tokenizer, **kwargs), model


def test_cancelling_frees_slots_and_sequences(tiny_model_path: Path) -> None:
    engine, model = scripted_engine(tiny_model_path, slots=1, cache_entries=0)
    endless = GenerationRequest(tuple(model.tokenize("SAY:abc" + FOREVER)), GenerationOptions(max_tokens=1000))
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
    assert model.backend.live_sequences == 0
    assert engine.stats.finished["cancelled"] == 2


def test_a_failing_backend_fails_that_batch_only(tiny: Model) -> None:
    backend = Recorder(tiny.backend, fail_decode_at=3)
    engine = BatchEngine(backend, tiny.tokenizer, slots=2, cache_entries=0)
    requests = [GenerationRequest(p, GenerationOptions(max_tokens=8)) for p in prompts(tiny, 3)]
    collector = run_all(engine, requests)
    failed = [i for i in range(3) if isinstance(collector.events[i][-1], Failed)]
    assert failed == [0, 1]
    assert "device lost" in collector.events[0][-1].message
    assert collector.finished(2).timings.generated_tokens == 8
    assert engine.running == 0 and engine.stats.failed == 2


def test_the_engine_thread_serves_and_stops(tiny_model_path: Path) -> None:
    engine, model = scripted_engine(tiny_model_path, slots=2)
    engine.start()
    done = threading.Event()
    texts: list[str] = []

    def sink(events) -> None:
        for event in events:
            if isinstance(event, ContentDelta):
                texts.append(event.text)
            if isinstance(event, Finished):
                done.set()

    engine.submit(GenerationRequest(tuple(model.tokenize("SAY:threaded")), GenerationOptions()), sink)
    assert done.wait(10)
    assert "".join(texts) == "threaded"
    left = Collector()
    engine.submit(GenerationRequest(tuple(model.tokenize("SAY:x" + FOREVER)), GenerationOptions()), left.sink(0))
    engine.stop()
    assert left.finished(0).reason == "cancelled"
    assert model.backend.live_sequences == 0  # the prefix cache was emptied too
