"""A test-only backend that "says" chosen text, so protocol tests can check every field exactly.

The prompt decides the script: the text after the last `SAY:` in it, up to the end of that turn or tool
response (or "OK" when there is none), followed by the end token. So a test writes what the model answers into its
own request, e.g. a user message "SAY:<tool_call>...</tool_call>" or a tool result "SAY:It is sunny."
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from cmpchat.backends.base import Backend
from cmpchat.model.config import ModelConfig
from cmpchat.tokenizer import Tokenizer

DIRECTIVE = "SAY:"
FOREVER = "FOREVER"
"""A script ending with this word never emits the end token (for cancellation and queue tests)."""
EXPLODE = "EXPLODE"
"""A script ending with this word makes the decode step raise, as a failing device would."""


class ScriptedBackend(Backend):
    name = "scripted"

    def __init__(self, config: ModelConfig, tokenizer: Tokenizer, *, step_delay: float = 0.0) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.step_delay = step_delay
        self.end_token = tokenizer.encode("<|im_end|>")[0]
        self.prompts: list[str] = []
        self.prefilled_tokens = 0
        self.live_sequences = 0
        self._lock = threading.Lock()

    def new_sequence(self) -> dict[str, Any]:
        with self._lock:
            self.live_sequences += 1
        return {"tokens": [], "prompt": 0, "script": [self.end_token]}

    def copy_sequence(self, sequence: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.live_sequences += 1
        return {"tokens": list(sequence["tokens"]), "prompt": sequence["prompt"], "script": sequence["script"]}

    def release(self, sequence: Any) -> None:
        with self._lock:
            self.live_sequences -= 1

    def sequence_length(self, sequence: dict[str, Any]) -> int:
        return len(sequence["tokens"])

    def prefill(self, sequence, tokens: Sequence[int], *, positions=None, all_logits: bool = False) -> np.ndarray:
        sequence["tokens"] += list(tokens)
        sequence["prompt"] = len(sequence["tokens"])
        text = self.tokenizer.decode(sequence["tokens"])
        self.prompts.append(text)
        self.prefilled_tokens += len(tokens)
        sequence["script"] = self._script(text)
        return self._logits(sequence)

    def decode(self, sequences, tokens: Sequence[int]) -> np.ndarray:
        if self.step_delay:
            time.sleep(self.step_delay)
        if any(sequence["script"] is None for sequence in sequences):
            raise RuntimeError("the device fell off the bus")
        for sequence, token in zip(sequences, tokens, strict=True):
            sequence["tokens"].append(token)
        return np.stack([self._logits(sequence) for sequence in sequences])

    def _script(self, prompt: str) -> list[int] | None:
        start = prompt.rfind(DIRECTIVE)
        if start < 0:
            return self.tokenizer.encode("OK") + [self.end_token]
        text = prompt[start + len(DIRECTIVE) :].split("<|im_end|>")[0].split("\n</tool_response>")[0]
        if text.endswith(EXPLODE):
            return None
        if text.endswith(FOREVER):
            return self.tokenizer.encode(text[: -len(FOREVER)] or "x", parse_special=True)
        return self.tokenizer.encode(text, parse_special=True) + [self.end_token]

    def _logits(self, sequence: dict[str, Any]) -> np.ndarray:
        script = sequence["script"] or self.tokenizer.encode("x")
        step = len(sequence["tokens"]) - sequence["prompt"]
        logits = np.zeros(self.config.vocab_size, dtype=np.float32)
        # A never-ending script repeats its last token.
        logits[script[min(step, len(script) - 1)]] = 10.0
        return logits
