"""Constrained decoding in the engine on the tiny random model: a grammar's reply follows it (batched beside
free rows, which stay exactly what they are alone), and a grammar that fails fails its request alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cmpchat.api import Model, open_model
from cmpchat.engine.constraint import GrammarError, GrammarMatcher, check_grammar, json_schema_grammar, lark_grammar
from cmpchat.engine.engine import Engine
from cmpchat.engine.events import Finished
from cmpchat.engine.reply import GenerationOptions
from cmpchat.engine.request import EngineEvent, GenerationRequest
from cmpchat.sampling import SamplingParams, allowed_ids

SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["S", "M", "L"]}, "n": {"type": "integer", "minimum": 0, "maximum": 50}},
    "required": ["size", "n"],
    "additionalProperties": False,
}
PROMPT_TEXT = "<|im_start|>user\nshirt?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> Model:
    return open_model(tiny_model_path, sequences=4, cache_states=0)


def finished(events: list[EngineEvent]) -> Finished:
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


def request(tiny: Model, seed: int, grammar: str | None) -> GenerationRequest:
    sampling = SamplingParams(temperature=1.0, seed=seed)
    prompt = tuple(tiny.tokenize(PROMPT_TEXT, parse_special=True))
    return GenerationRequest(prompt, GenerationOptions(sampling=sampling, max_tokens=120, grammar=grammar))


def test_constrained_rows_follow_their_grammar_and_free_rows_are_unchanged(tiny: Model) -> None:
    grammar = json_schema_grammar(SCHEMA)
    alone = Engine(tiny.backend, tiny.tokenizer, slots=1, cache_states=0)
    free_alone = finished(list(alone.generate(request(tiny, 9, None))))
    engine = Engine(tiny.backend, tiny.tokenizer, slots=4, cache_states=0)
    inboxes: list[list[EngineEvent]] = [[], [], [], []]
    for index, seed in enumerate([1, 2, 3]):
        engine.submit(request(tiny, seed, grammar), inboxes[index].extend)
    engine.submit(request(tiny, 9, None), inboxes[3].extend)
    engine.run_until_idle()
    for inbox in inboxes[:3]:
        reply = finished(inbox)
        assert reply.reason == "stop"
        value = json.loads(reply.content)
        assert set(value) == {"size", "n"} and value["size"] in "SML" and 0 <= value["n"] <= 50
    assert finished(inboxes[3]).token_ids == free_alone.token_ids


def test_the_matcher_allows_only_end_tokens_once_the_grammar_is_complete(tiny: Model) -> None:
    matcher = GrammarMatcher(lark_grammar('start: "ok"'), tiny.tokenizer)
    for token in tiny.tokenize("ok"):
        assert allowed_ids(matcher.allowed(), tiny.tokenizer.vocab_size)[token]
        matcher.accept(token)
    allowed = np.flatnonzero(allowed_ids(matcher.allowed(), tiny.tokenizer.vocab_size))
    assert set(allowed.tolist()) <= set(tiny.tokenizer.eos_token_ids) and len(allowed) > 0


def test_a_token_the_grammar_refuses_is_a_grammar_error(tiny: Model) -> None:
    matcher = GrammarMatcher(lark_grammar('start: "ok"'), tiny.tokenizer)
    with pytest.raises(GrammarError, match="grammar failed"):
        matcher.accept(tiny.tokenize("x")[0])


def test_bad_grammars_are_one_line_errors(tiny: Model) -> None:
    with pytest.raises(GrammarError) as caught:
        check_grammar(json_schema_grammar({"type": "strin"}), tiny.tokenizer)
    assert "strin" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(GrammarError):
        check_grammar(lark_grammar("start: missing_rule"), tiny.tokenizer)


def test_a_grammar_cannot_be_combined_with_ignore_eos() -> None:
    with pytest.raises(ValueError, match="ignore_eos"):
        GenerationOptions(grammar=json_schema_grammar(SCHEMA), ignore_eos=True)
