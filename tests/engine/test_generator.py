"""The generation loop: events, finish reasons, stop rules, cancellation, timings.

A scripted backend (test-only) makes the model "say" chosen text, so each rule is checked exactly;
the tiny random model checks the same loop end to end on the reference backend.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from cmpchat.api import open_model
from cmpchat.backends.base import Backend, Choice
from cmpchat.engine.events import (
    ContentDelta,
    DecodeProgress,
    Finished,
    PromptProgress,
    ReasoningDelta,
    ToolCallEvent,
)
from cmpchat.engine.generator import GenerationOptions, Generator
from cmpchat.errors import CmpchatError
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from cmpchat.sampling import SamplingParams
from cmpchat.tokenizer import Tokenizer


class ScriptedBackend(Backend):
    """Emits a fixed token script through one-hot logits, whatever the input."""

    name = "scripted"

    def __init__(self, config: ModelConfig, script: Sequence[int]) -> None:
        self.config = config
        self.script = list(script)
        self.prefill_calls: list[int] = []

    def new_sequence(self):
        return {"length": 0}

    def copy_sequence(self, sequence):
        return dict(sequence)

    def sequence_length(self, sequence) -> int:
        return sequence["length"]

    def _logits(self, sequence) -> np.ndarray:
        step = sequence["length"] - sequence["prompt"]
        logits = np.zeros(self.config.vocab_size, dtype=np.float32)
        logits[self.script[min(step, len(self.script) - 1)]] = 10.0
        return logits

    def prefill(self, sequence, tokens, *, positions=None, all_logits=False):
        self.prefill_calls.append(len(tokens))
        sequence["length"] += len(tokens)
        sequence["prompt"] = sequence["length"]
        return self._logits(sequence)

    def decode(self, sequences, tokens):
        for seq in sequences:
            seq["length"] += 1
        return np.stack([self._logits(seq) for seq in sequences])


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    model_file = ModelFile(tiny_model_path)
    return ModelConfig.from_model_file(model_file), Tokenizer.from_metadata(model_file.metadata)


def scripted(tiny, text: str, end: bool = True) -> Generator:
    config, tokenizer = tiny
    script = tokenizer.encode(text) + ([tokenizer.encode("<|im_end|>")[0]] if end else [])
    return Generator(ScriptedBackend(config, script), tokenizer)


def run(generator: Generator, options=None, prompt=(1, 2, 3), **kwargs):
    events = list(generator.generate(list(prompt), options, **kwargs))
    assert isinstance(events[-1], Finished) and not any(isinstance(e, Finished) for e in events[:-1])
    return events, events[-1]


def text_of(events, kind) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def test_content_streams_and_end_token_stops(tiny):
    reply_tokens = len(tiny[1].encode("Hello there"))
    events, finished = run(scripted(tiny, "Hello there"))
    assert text_of(events, ContentDelta) == "Hello there" == finished.content
    assert finished.reason == "stop"
    assert finished.timings.generated_tokens == reply_tokens + 1  # the end token counts
    assert finished.timings.decode_steps == reply_tokens
    assert finished.timings.prompt_tokens == 3
    assert finished.timings.time_to_first_token >= finished.timings.prompt_seconds
    assert sum(isinstance(e, DecodeProgress) for e in events) == finished.timings.decode_steps


class QueuedChoice(Choice):
    """A GPU backend's choice: reading the ids waits for the step queued before."""

    def __init__(self, backend: QueuingBackend, ids: list[int]) -> None:
        super().__init__(ids)
        self.backend = backend

    def ids(self) -> list[int]:
        self.backend.log.append("read")
        if self.backend.queued:
            time.sleep(0.02)
            self.backend.queued = False
        return super().ids()


class QueuingBackend(ScriptedBackend):
    """As a GPU backend: steps are only queued, the wait for one ends when a choice's ids are read, and a
    step can take a choice before its ids are read (`queued=False`: as the reference backend)."""

    def __init__(self, config, script, queued: bool = True) -> None:
        super().__init__(config, script)
        self.decode_is_queued = queued
        self.queued = False
        self.log: list[str] = []

    def decode(self, sequences, tokens):
        self.log.append("step")
        self.queued = True
        return super().decode(sequences, tokens)

    def decode_chosen(self, sequences, choice):
        return self.decode(sequences, [])  # the script ignores the tokens: nothing is read back here

    def choose(self, logits, params, histories, rngs):
        return QueuedChoice(self, self.sample(logits, params, histories, rngs))


def test_decode_time_covers_the_wait_for_each_token(tiny):
    config, tokenizer = tiny
    script = tokenizer.encode("one two three") + [tokenizer.encode("<|im_end|>")[0]]
    _, finished = run(Generator(QueuingBackend(config, script), tokenizer))
    timings = finished.timings
    assert timings.decode_steps == len(script) - 1
    assert timings.decode_seconds >= 0.02 * timings.decode_steps
    assert timings.decode_tokens_per_second <= 50


@pytest.mark.parametrize("queued", [True, False])
def test_a_queued_step_runs_while_the_token_text_is_handled(tiny, queued):
    config, tokenizer = tiny
    script = tokenizer.encode("one two three") + [tokenizer.encode("<|im_end|>")[0]]
    backend = QueuingBackend(config, script, queued)
    for event in Generator(backend, tokenizer).generate([1, 2, 3]):
        if isinstance(event, ContentDelta):
            backend.log.append("text")
    if queued:
        # The step that consumes a token is queued before the token's id is read back, so it runs while the
        # text is made; the end token's step is queued too (its id is not known in time) and goes unused.
        assert backend.log[:3] == ["step", "read", "text"]
        assert backend.log.count("step") == len(script)
    else:
        assert backend.log[:2] == ["read", "text"]
        assert backend.log.count("step") == len(script) - 1  # the end token needs no step


def test_a_refused_queued_step_fails_the_reply_after_the_tokens_text(tiny):
    # A backend refuses a step when its own context is full; the token chosen before still reaches the reader.
    config, tokenizer = tiny
    backend = QueuingBackend(config, tokenizer.encode("abcdefgh"))
    decode = backend.decode

    def refuse_the_third(sequences, tokens):
        if backend.log.count("step") == 2:
            raise CmpchatError("the conversation reached the 5-token context this GPU holds; start a new one")
        return decode(sequences, tokens)

    backend.decode = refuse_the_third
    text = ""
    with pytest.raises(CmpchatError, match="context"):
        for event in Generator(backend, tokenizer).generate([1, 2, 3]):
            text += event.text if isinstance(event, ContentDelta) else ""
    assert text == "abc"


def test_no_step_is_queued_past_the_token_budget(tiny):
    config, tokenizer = tiny
    backend = QueuingBackend(config, tokenizer.encode("abcdefgh"))
    _, finished = run(Generator(backend, tokenizer), GenerationOptions(max_tokens=3))
    assert (finished.content, finished.reason) == ("abc", "length")
    assert backend.log.count("step") == 2


def test_a_stop_string_after_a_queued_step_still_ends_the_reply(tiny):
    config, tokenizer = tiny
    backend = QueuingBackend(config, tokenizer.encode("one, two. three"))
    _, finished = run(Generator(backend, tokenizer), GenerationOptions(stop=(". ",)))
    assert (finished.content, finished.reason) == ("one, two", "stop")


def test_max_tokens_ends_with_length(tiny):
    _, finished = run(scripted(tiny, "abcdefgh"), GenerationOptions(max_tokens=3))
    assert (finished.content, finished.reason) == ("abc", "length")
    assert finished.timings.decode_steps == 2  # the third token needs no further step


def test_stop_string_is_cut_out(tiny):
    _, finished = run(scripted(tiny, "one, two. three"), GenerationOptions(stop=(". ",)))
    assert (finished.content, finished.reason) == ("one, two", "stop")


def test_reasoning_then_tool_call(tiny):
    reply = "thinking hard</think>\n\n<tool_call>\n<function=get>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    events, finished = run(scripted(tiny, reply), starts_in_reasoning=True)
    assert text_of(events, ReasoningDelta) == "thinking hard" == finished.reasoning
    calls = [e.call for e in events if isinstance(e, ToolCallEvent)]
    assert [(c.name, c.arguments) for c in calls] == [("get", {"city": "Paris"})]
    assert finished.reason == "tool_calls"


def test_raw_text_keeps_tags_as_content(tiny):
    reply = "<think>plan</think> answer <tool_call>\n<function=get>\n</function>\n</tool_call>"
    events, finished = run(scripted(tiny, reply), GenerationOptions(raw_text=True), starts_in_reasoning=True)
    assert text_of(events, ContentDelta) == reply == finished.content
    assert finished.reasoning == "" and finished.tool_calls == () and finished.reason == "stop"


def test_prefill_runs_in_chunks_with_progress(tiny):
    generator = scripted(tiny, "x")
    events, _ = run(generator, GenerationOptions(prefill_chunk=4), prompt=range(1, 11))
    assert generator.backend.prefill_calls == [4, 4, 2]
    assert [(e.done, e.total) for e in events if isinstance(e, PromptProgress)] == [(4, 10), (8, 10), (10, 10)]


def test_cancel_keeps_what_was_generated(tiny):
    cancel = threading.Event()
    generator = scripted(tiny, "abcdefghijklmnop", end=False)
    seen = []
    for event in generator.generate([1, 2], cancel=cancel):
        if isinstance(event, ContentDelta):
            seen.append(event.text)
            if len(seen) == 3:
                cancel.set()
        finished = event
    assert finished.reason == "cancelled"
    assert finished.content == "abc"


def test_prompt_longer_than_context_is_refused(tiny):
    config, _ = tiny
    with pytest.raises(CmpchatError, match="context"):
        list(scripted(tiny, "x").generate([1] * config.context_length))


def test_tiny_model_end_to_end(tiny_model_path):
    from cmpchat.chat.messages import Message

    model = open_model(tiny_model_path)
    greedy = GenerationOptions(max_tokens=12)
    first = list(model.chat([Message("user", "hi")], greedy))[-1]
    again = list(model.chat([Message("user", "hi")], greedy))[-1]
    assert first.content == again.content and first.timings.generated_tokens >= 1
    sampled = GenerationOptions(max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=3))
    one = list(model.chat([Message("user", "hi")], sampled))[-1]
    two = list(model.chat([Message("user", "hi")], sampled))[-1]
    assert one.content == two.content
