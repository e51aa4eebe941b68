"""`logprobs` / `top_logprobs` through the official openai client on the tiny random model: OpenAI's shapes,
streamed and not, with values equal to the log-softmax of the reference backend's raw logits within 1e-4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from openai.types import Completion
from openai.types.responses import Response, ResponseOutputText

from cmpchat.api import Model, open_model
from cmpchat.chat.messages import Message
from tests.server.conftest import client_for
from tests.server.live import LiveServer

STEPS = 6
TOP = 3


@pytest.fixture(scope="module")
def client(tiny_server: LiveServer) -> openai.OpenAI:
    return client_for(tiny_server)


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> Model:
    return open_model(tiny_model_path, sequences=2, cache_states=0)


def greedy_logprobs(model: Model, prompt: list[int], steps: int) -> list[tuple[int, np.ndarray]]:
    """(chosen id, log-softmax row) of each greedy step, from the reference backend's raw logits."""
    backend = model.backend
    sequence = backend.new_sequence()
    try:
        logits = backend.to_host(backend.prefill(sequence, prompt))[0]
        out = []
        for _ in range(steps):
            row = logits.astype(np.float64)
            logsoftmax = row - row.max() - np.log(np.exp(row - row.max()).sum())
            token = int(np.argmax(logits))
            out.append((token, logsoftmax))
            logits = backend.to_host(backend.decode([sequence], [token]))[0]
        return out
    finally:
        backend.release(sequence)


def text(model: Model, token: int) -> str:
    return model.tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def chat_prompt(model: Model) -> list[int]:
    return list(model.chat_request([Message("user", "Say something.")]).prompt)


def check_chat_entries(entries, model: Model) -> None:
    expected = greedy_logprobs(model, chat_prompt(model), len(entries))
    assert len(entries) > 0
    for entry, (token, logsoftmax) in zip(entries, expected, strict=True):
        assert entry.token == text(model, token) and entry.bytes == list(model.tokenizer.token_bytes(token))
        assert abs(entry.logprob - logsoftmax[token]) < 1e-4
        best = np.argsort(-logsoftmax, kind="stable")[:TOP]
        assert [alt.token for alt in entry.top_logprobs] == [text(model, int(i)) for i in best]
        np.testing.assert_allclose([alt.logprob for alt in entry.top_logprobs], logsoftmax[best], atol=1e-4)


def test_chat_logprobs_are_the_log_softmax_of_the_raw_logits(client: openai.OpenAI, reference: Model) -> None:
    # Penalties and a seed do not change what is reported: raw logits, before them (the tokens are greedy).
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=STEPS,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
        extra_body={"ignore_eos": True},
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == STEPS
    check_chat_entries(logprobs.content, reference)


def test_streamed_chat_logprobs_come_with_the_chunks(client: openai.OpenAI, reference: Model) -> None:
    entries = []
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=STEPS,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            entries += chunk.choices[0].logprobs.content or []
    assert len(entries) == STEPS
    check_chat_entries(entries, reference)


def test_no_logprobs_unless_asked(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(client: openai.OpenAI, reference: Model, stream: bool) -> None:
    prompt = "Once upon a time"
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    completion = ""
    replies: list[Completion] = []
    if stream:
        replies += client.completions.create(
            model="tiny", prompt=prompt, max_tokens=STEPS, temperature=0, logprobs=TOP, stream=True
        )
    else:
        replies.append(
            client.completions.create(model="tiny", prompt=prompt, max_tokens=STEPS, temperature=0, logprobs=TOP)
        )
    for reply in replies:
        choice = reply.choices[0]
        completion += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens or []
            values += [v for v in choice.logprobs.token_logprobs or [] if v is not None]
            tops += [t for t in choice.logprobs.top_logprobs or [] if t is not None]
            offsets += choice.logprobs.text_offset or []
    expected = greedy_logprobs(reference, reference.tokenize(prompt, parse_special=True), len(tokens))
    assert 0 < len(tokens) <= STEPS and len(values) == len(tops) == len(offsets) == len(tokens)
    assert "".join(tokens).startswith(completion) and offsets[0] == 0
    for i, (token, logsoftmax) in enumerate(expected):
        assert tokens[i] == text(reference, token)
        assert abs(values[i] - logsoftmax[token]) < 1e-4
        # The legacy shape keys alternatives by text: partial characters (all "\ufffd") share one key.
        assert 0 < len(tops[i]) <= TOP and abs(max(tops[i].values()) - logsoftmax.max()) < 1e-4
        if i:
            assert offsets[i] == offsets[i - 1] + len(tokens[i - 1])


LOGPROBS_INCLUDE = ["message.output_text.logprobs"]


def respond(client: openai.OpenAI, **fields: Any) -> Any:
    """A response to "Say something." with thinking off, greedy."""
    return client.responses.create(
        model="tiny",
        input="Say something.",
        max_output_tokens=STEPS,
        temperature=0,
        reasoning={"effort": "none"},
        **fields,
    )


def check_response_entries(entries, model: Model) -> None:
    """The Responses API's `output_text` logprobs: chat's entries, for the reply that thinking off makes."""
    prompt = list(model.chat_request([Message("user", "Say something.")], enable_thinking=False).prompt)
    expected = greedy_logprobs(model, prompt, len(entries))
    assert 0 < len(entries) <= STEPS
    for entry, (token, logsoftmax) in zip(entries, expected, strict=True):
        assert entry.token == text(model, token) and entry.bytes == list(model.tokenizer.token_bytes(token))
        assert abs(entry.logprob - logsoftmax[token]) < 1e-4
        best = np.argsort(-logsoftmax, kind="stable")[:TOP]
        assert [alt.token for alt in entry.top_logprobs] == [text(model, int(i)) for i in best]
        np.testing.assert_allclose([alt.logprob for alt in entry.top_logprobs], logsoftmax[best], atol=1e-4)


def output_text_part(response: Response) -> ResponseOutputText:
    (message,) = response.output
    assert message.type == "message"
    (part,) = message.content
    assert part.type == "output_text" and part.logprobs is not None
    return part


def test_response_logprobs_are_the_log_softmax_of_the_raw_logits(client: openai.OpenAI, reference: Model) -> None:
    response = respond(client, include=LOGPROBS_INCLUDE, top_logprobs=TOP)
    assert response.top_logprobs == TOP
    part = output_text_part(response)
    assert part.logprobs is not None
    check_response_entries(part.logprobs, reference)
    assert b"".join(bytes(entry.bytes) for entry in part.logprobs).decode("utf-8", errors="replace") == part.text


def test_streamed_response_logprobs_come_with_the_deltas(client: openai.OpenAI, reference: Model) -> None:
    events = list(respond(client, include=LOGPROBS_INCLUDE, top_logprobs=TOP, stream=True))
    deltas = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    (done,) = [event for event in events if event.type == "response.output_text.done"]
    assert [entry.token for entry in done.logprobs] == [entry.token for entry in deltas]
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    part = output_text_part(last.response)
    assert part.logprobs is not None
    assert [(e.token, e.logprob) for e in part.logprobs] == [(e.token, e.logprob) for e in deltas]
    check_response_entries(part.logprobs, reference)
    assert respond(client).output_text == part.text


def test_response_logprobs_only_when_asked(client: openai.OpenAI) -> None:
    plain = respond(client)
    assert output_text_part(plain).logprobs == [] and plain.top_logprobs is None
    # The chosen tokens alone (top_logprobs 0); top_logprobs without `include` asks for them too.
    entries = output_text_part(respond(client, include=LOGPROBS_INCLUDE)).logprobs
    assert entries and all(entry.top_logprobs == [] for entry in entries)
    top = output_text_part(respond(client, top_logprobs=1)).logprobs
    assert top is not None and [len(entry.top_logprobs) for entry in top] == [1] * len(entries)
    # OpenAI's other include values name outputs this server never makes: nothing is added for them.
    assert output_text_part(respond(client, include=["reasoning.encrypted_content"])).logprobs == []
