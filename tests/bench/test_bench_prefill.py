"""The prefill benchmark's timing loop (on a recording stand-in backend), report and JSON."""

from __future__ import annotations

from types import SimpleNamespace

from cmpchat.bench.llama_cpp import LlamaResult
from cmpchat.bench.prefill import WARMUP_PROMPTS, PrefillRun, run_prefill
from cmpchat.bench.report import format_prefill, prefill_json


class RecordingBackend:
    """Records prefill calls; sequences are plain counters."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(vocab_size=100)
        self.stream = SimpleNamespace(synchronize=lambda: None)
        self.calls: list[tuple[int, int]] = []
        self.released: list[int] = []
        self._next = 0

    def new_sequence(self) -> int:
        self._next += 1
        return self._next

    def prefill(self, sequence: int, tokens: list[int]) -> None:
        assert all(0 <= t < 100 for t in tokens)
        self.calls.append((sequence, len(tokens)))

    def release(self, sequence: int) -> None:
        self.released.append(sequence)


def test_every_chunk_size_is_warmed_up_then_each_prompt_is_fed_in_calls() -> None:
    backend = RecordingBackend()
    runs = run_prefill(backend, [1000, 30], call_tokens=512, say=lambda _: None)  # type: ignore[arg-type]
    warmup = len(WARMUP_PROMPTS)
    assert [n for _, n in backend.calls[:warmup]] == list(WARMUP_PROMPTS)
    timed = backend.calls[warmup:]
    assert [n for _, n in timed] == [512, 488, 30]
    assert timed[0][0] == timed[1][0] != timed[2][0]  # one fresh sequence per prompt
    assert len(backend.released) == warmup + 2
    assert [run.tokens for run in runs] == [1000, 30] and all(run.seconds > 0 for run in runs)


def test_report_compares_with_llama_cpp_and_lists_the_published_cmp_figures() -> None:
    runs = [PrefillRun(1160, 0.5), PrefillRun(297, 0.2)]
    llama = [LlamaResult(1160, 0, 0, 2000.0, "b1 (abc)"), LlamaResult(0, 128, 0, 50.0, "b1 (abc)")]
    text = "\n".join(format_prefill("m.gguf", "H200", runs, llama, "9B"))
    assert "    1160     0.50    2320.0    2000.0       1.16" in text
    assert "     297     0.20    1485.0         -          -" in text
    assert "llama.cpp: 199" not in text and "llama.cpp: 297: 199" in text
    assert "qengine: 297: 594" in text
    payload = prefill_json("m.gguf", "H200", runs, llama, "9B")
    assert payload["runs"][0] == {"tokens": 1160, "seconds": 0.5, "tok_s": 2320.0, "llama_cpp_tok_s": 2000.0}
    assert payload["runs"][1]["llama_cpp_tok_s"] is None
