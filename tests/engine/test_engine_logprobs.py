"""Log-probabilities in the engine on the tiny random model: one `TokenLogprobs` per generated token but the end
token, before its text, equal to the log-softmax of the reference backend's raw logits (before penalties and
temperature) within 1e-4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cmpchat.api import Model, open_model
from cmpchat.engine.engine import Engine
from cmpchat.engine.events import ContentDelta, Finished, TokenLogprobs
from cmpchat.engine.reply import GenerationOptions
from cmpchat.engine.request import GenerationRequest
from cmpchat.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> Model:
    return open_model(tiny_model_path, sequences=4, cache_states=0)


def test_logprobs_are_the_raw_log_softmax_before_each_token_s_text(tiny: Model) -> None:
    prompt = tuple(tiny.tokenize("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", parse_special=True))
    sampling = SamplingParams(temperature=1.3, repetition_penalty=1.6, presence_penalty=0.5, seed=3)
    options = GenerationOptions(sampling=sampling, max_tokens=12, logprobs=3, raw_text=True)
    events = list(
        Engine(tiny.backend, tiny.tokenizer, slots=1, cache_states=0).generate(GenerationRequest(prompt, options))
    )
    finished = events[-1]
    assert isinstance(finished, Finished)
    reports = [event for event in events if isinstance(event, TokenLogprobs)]
    ends = tiny.tokenizer.eos_token_ids
    assert [r.token for r in reports] == [t for t in finished.token_ids if t not in ends]
    first_text = next(i for i, event in enumerate(events) if isinstance(event, ContentDelta))
    assert isinstance(events[first_text - 1], TokenLogprobs)  # a token's report comes before its text
    sequence = tiny.backend.new_sequence()
    try:
        rows = tiny.backend.score(sequence, [*prompt, *finished.token_ids])[len(prompt) - 1 :].astype(np.float64)
    finally:
        tiny.backend.release(sequence)
    for step, report in enumerate(reports):
        row = rows[step]
        logsoftmax = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert abs(report.logprob - logsoftmax[report.token]) < 1e-4
        assert [t for t, _ in report.top] == np.argsort(-logsoftmax, kind="stable")[:3].tolist()
        np.testing.assert_allclose([v for _, v in report.top], np.sort(logsoftmax)[::-1][:3], atol=1e-4)


def test_no_reports_unless_asked(tiny: Model) -> None:
    prompt = tuple(tiny.tokenize("hi"))
    options = GenerationOptions(max_tokens=3)
    events = Engine(tiny.backend, tiny.tokenizer, slots=1, cache_states=0).generate(GenerationRequest(prompt, options))
    assert not any(isinstance(event, TokenLogprobs) for event in events)
