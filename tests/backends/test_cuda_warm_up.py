"""Warm-up prepares every step the engine then runs: after `CudaBackend.warm_up`, serving requests of every
batch size and prompt length up to the engine's slots asks for no decode step, prompt-tail step or long-prompt
step that warm-up did not build. The steps themselves are stubbed (their kernels have their own tests; under the
simulator a real long-prompt step takes minutes): this checks the bookkeeping, on the simulator's backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.gpu.prompt_step import PROMPT_ROWS
from cmpchat.backends.gpu.stage import Stage
from cmpchat.engine.engine import Engine
from cmpchat.engine.reply import GenerationOptions
from cmpchat.engine.request import GenerationRequest
from cmpchat.model.gguf_file import ModelFile
from cmpchat.tokenizer import Tokenizer


class StepLog:
    def __init__(self) -> None:
        self.decode: set[tuple[int, int, bool]] = set()
        """(decode group, rows bucket, rows are one prompt's tokens) of each decode step run"""
        self.prompt: set[int] = set()
        self.prepared: set[int] = set()


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> dict[str, StepLog]:
    """Where the stubbed steps record themselves: log["now"], which a test points at a fresh StepLog."""
    log = {"now": StepLog()}
    monkeypatch.setattr(
        Stage, "run_decode", lambda self, bucket, prompt, group=0: log["now"].decode.add((group, bucket, prompt))
    )
    monkeypatch.setattr(Stage, "prepare_prompt_step", lambda self, slot, run: log["now"].prepared.add(slot))
    monkeypatch.setattr(Stage, "run_prompt", lambda self, slot: log["now"].prompt.add(slot))
    return log


@pytest.mark.parametrize("slots", [3, 5])
def test_serving_after_warm_up_runs_only_prepared_steps(tiny_model_path: Path, log, slots: int) -> None:
    model_file = ModelFile(tiny_model_path)
    backend = CudaBackend(model_file, sequences=slots, saved_states=2, context=1024, page_tokens=128)
    assert backend.stages[0].prompt is not None  # the tiny model takes the long-prompt step
    warmed = log["now"]
    backend.warm_up(max_rows=slots)
    used = log["now"] = StepLog()
    engine = Engine(backend, Tokenizer.from_metadata(model_file.metadata), slots=slots, cache_states=2)
    # Prompts of every tail length and past a long-prompt step, more requests than slots, so every batch size
    # from one to `slots` decodes.
    lengths = [1, 5, 16, 17, PROMPT_ROWS + 3, 40, 2 * PROMPT_ROWS, 9]
    for index, length in enumerate(lengths):
        prompt = tuple((index * 31 + i) % 200 for i in range(length))
        engine.submit(
            GenerationRequest(prompt, GenerationOptions(max_tokens=3 + index, ignore_eos=True)), lambda e: None
        )
    engine.run_until_idle()
    assert used.decode and used.prompt  # the engine ran both kinds of step
    assert used.decode <= warmed.decode, used.decode - warmed.decode
    assert used.prompt <= warmed.prepared, used.prompt - warmed.prepared
    assert {bucket for _, bucket, prompt in used.decode if not prompt} >= {1}
    # The one-row selections with a grammar's mask and with log-probabilities are captured too (their kernels
    # compile on first use, which would otherwise fall on the first request that asks for them).
    graphs = backend._pipeline.samplers[0]._by_batch[1].graphs
    assert {(greedy, masked, reporting) for greedy in (True, False) for masked in (True, False)
            for reporting in (True, False)} <= set(graphs)  # fmt: skip
