"""Token log-probabilities in OpenAI's shapes: chat's `logprobs.content` entries (the Responses API's `output_text`
`logprobs` are the same entries) and the completions API's `tokens` / `token_logprobs` / `top_logprobs` /
`text_offset` lists, from the engine's `TokenLogprobs` (ids and log-softmax values of the raw logits, one per
generated token but the end token); and which text each token's values go with (`LogprobRouter`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cmpchat.engine.events import ContentDelta, ReasoningDelta, ToolCallEvent
from cmpchat.engine.request import EngineEvent
from cmpchat.sampling import TokenLogprobs
from cmpchat.tokenizer import Tokenizer


class LogprobRouter:
    """Gives each token's log-probabilities to the event that first carries text after it: a reasoning or content
    delta, or a tool call. The engine reports a token's values before the text it completes, and text can wait for
    several tokens (a character split across tokens, a tag being parsed, a possible stop string); the tokens that
    no text follows (a stop string's) stay `unsent`."""

    def __init__(self) -> None:
        self.unsent: list[TokenLogprobs] = []

    def route(self, event: EngineEvent) -> list[TokenLogprobs]:
        """The tokens whose text `event` is the first to carry (none for an event without text); a
        `TokenLogprobs` is held until then."""
        if isinstance(event, TokenLogprobs):
            self.unsent.append(event)
            return []
        if isinstance(event, ToolCallEvent) or (isinstance(event, ReasoningDelta | ContentDelta) and event.text):
            return self.take()
        return []

    def take(self) -> list[TokenLogprobs]:
        """The tokens held so far, handed over."""
        taken, self.unsent = self.unsent, []
        return taken


class LogprobShapes:
    """Builds the response fields; token text is each id's bytes as UTF-8 (a token that ends inside a character
    shows U+FFFD there, and its exact `bytes` besides, as OpenAI does)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def chat(self, items: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """A chat choice's `logprobs` object."""
        return {"content": self.entries(items), "refusal": None}

    def entries(self, items: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        """One `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}` per token: chat's `content`
        entries and the Responses API's `output_text` `logprobs`."""
        return [self._entry(item) for item in items]

    def completion(self, items: Sequence[TokenLogprobs], offset: int) -> dict[str, Any]:
        """A completion choice's `logprobs` object; `offset` is where the first token's text starts in the
        completion's text."""
        texts = [self._text(item.token) for item in items]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [item.logprob for item in items],
            "top_logprobs": [self._top_by_text(item) for item in items],
            "text_offset": offsets,
        }

    def text_length(self, items: Sequence[TokenLogprobs]) -> int:
        """Characters the tokens' texts take (to continue `text_offset` in the next streamed chunk)."""
        return sum(len(self._text(item.token)) for item in items)

    def _top_by_text(self, item: TokenLogprobs) -> dict[str, float]:
        """The legacy shape keys alternatives by text; where tokens share one (partial characters all read
        U+FFFD), the likeliest keeps it."""
        top: dict[str, float] = {}
        for token, value in item.top:
            top.setdefault(self._text(token), value)
        return top

    def _entry(self, item: TokenLogprobs) -> dict[str, Any]:
        top = [self._alternative(token, value) for token, value in item.top]
        return {**self._alternative(item.token, item.logprob), "top_logprobs": top}

    def _alternative(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self._text(token), "logprob": logprob, "bytes": list(self.tokenizer.token_bytes(token))}

    def _text(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")
