"""The prefill benchmark's timing loop (on a recording stand-in backend), its CMP projection, report and JSON."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cmpchat.backends.gpu.prompt_step import PROMPT_ROWS
from cmpchat.bench.kernel_families import FamilyTime, kernel_family
from cmpchat.bench.llama_cpp import LlamaResult
from cmpchat.bench.pipeline_schedule import HostLink, prefill_seconds
from cmpchat.bench.prefill import CMP_DP4A_PER_SECOND, WARMUP_PROMPTS, PrefillRates, PrefillRun, run_prefill
from cmpchat.bench.report import format_prefill, prefill_json

# An H200-like GPU: 16e12 dp4a/s (128 TOPS), 4.5 TB/s.
RATES = PrefillRates(read_bandwidth=4.5e12, dp4a_per_second=16e12)


class RecordingBackend:
    """Records prefill calls; sequences are plain counters; no weights."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(vocab_size=100, hidden_size=64)
        self.stages = [SimpleNamespace(weights=SimpleNamespace(layers={}))]
        self.prompt_rows = PROMPT_ROWS
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

    def synchronize(self) -> None:
        pass


def test_every_step_is_warmed_up_then_each_prompt_is_fed_in_calls_and_profiled() -> None:
    backend = RecordingBackend()
    profiled: list[int] = []

    def profile_step(sequence: int) -> list[tuple[list[str], list[float]]]:
        profiled.append(sequence)
        return [(["gemm_q8_64_64k2p", "gdn_prefill_sequential"], [3e-3, 1e-3]), (["gemm_q8_64_64k2p"], [2e-3])]

    runs = run_prefill(backend, [1000, 30], call_tokens=512, say=lambda _: None, profile_step=profile_step)  # type: ignore[arg-type]
    warmup = len(WARMUP_PROMPTS)
    assert WARMUP_PROMPTS[0] > PROMPT_ROWS  # the long-prompt step is compiled and captured before timing
    assert [n for _, n in backend.calls[:warmup]] == list(WARMUP_PROMPTS)
    timed = backend.calls[warmup:]
    assert [n for _, n in timed] == [512, 488, 30]
    assert timed[0][0] == timed[1][0] != timed[2][0]  # one fresh sequence per prompt
    assert profiled == [timed[0][0]]  # the 30-token prompt has no long-prompt step to profile
    assert len(backend.released) == warmup + 2
    assert [run.tokens for run in runs] == [1000, 30] and all(run.seconds > 0 for run in runs)
    assert [(f.family, f.launches) for f in runs[0].families] == [("GEMM", 2), ("GDN", 1)]  # over both stages
    assert [[(f.family, f.launches) for f in stage] for stage in runs[0].stage_families] == [
        [("GEMM", 1), ("GDN", 1)],
        [("GEMM", 1)],
    ]
    assert runs[1].families == [] and runs[1].stage_families == []


def test_the_pipeline_projection_replaces_the_long_steps_by_their_schedule() -> None:
    stage = [FamilyTime("GEMM", 10, 0.03, 0)]
    run = PrefillRun(tokens=4 * PROMPT_ROWS, seconds=0.4, families=stage * 2, stage_families=[stage, stage],
                     hidden_size=64)  # fmt: skip
    one_card = run.cmp_projection(RATES)
    assert one_card is not None
    free = HostLink(bytes_per_second=float("inf"), latency=0.0)
    projected = run.pipeline_projection(RATES, free)
    assert projected is not None and projected.one_card_tokens_per_second == one_card
    # Each chunk gets a quarter of the one-card time (4 chunks, no tail), half of it on each stage.
    per_stage = run.tokens / one_card / 4 / 2
    long_steps = prefill_seconds([per_stage] * 2, 4, 0, free).seconds  # 5 ticks of one stage's step
    assert long_steps == pytest.approx(5 * per_stage)
    expected = run.tokens / long_steps
    assert projected.tokens_per_second == pytest.approx(expected) and projected.speedup == pytest.approx(8 / 5)
    assert PrefillRun(1024, 0.4, stage, stage_families=[stage]).pipeline_projection(RATES) is None


def test_a_pipeline_never_projects_more_than_one_card_per_stage_however_dear_the_last_step() -> None:
    """The profiled step is the prompt's last; at 18K tokens it costs twice the prompt's average step (H200,
    27B, 2026-12-02), and taking it for every chunk once projected 4.7x on three cards."""
    last = [FamilyTime("GEMM", 10, 0.03, 0), FamilyTime("attention", 4, 0.05, 0)]
    chunks = 72
    run = PrefillRun(tokens=chunks * PROMPT_ROWS, seconds=chunks * 0.24 / 2, families=last * 3,
                     stage_families=[last] * 3, hidden_size=64)  # fmt: skip
    free = HostLink(bytes_per_second=float("inf"), latency=0.0)
    projected = run.pipeline_projection(RATES, free)
    assert projected is not None
    assert projected.speedup == pytest.approx(3 * chunks / (chunks + 2))  # fill and drain: two ticks


def test_gemm_share_and_cmp_projection_follow_the_issue_formula() -> None:
    families = [FamilyTime("GEMM", 10, 0.06, 0), FamilyTime("GDN", 5, 0.01, 0), FamilyTime("attention", 4, 0.01, 0)]
    run = PrefillRun(tokens=1024, seconds=0.4, families=families, gemm_ops=int(4.8e12 * 0.06))
    assert run.gemm_share_of_peak(RATES) == pytest.approx(4.8e12 / 128e12)
    # CMP step: 0.06 x 16e12 / 4.3e12 + 0.02 x 4.5e12 / 818e9, against 0.08 s measured.
    projected_step = 0.06 * 16e12 / CMP_DP4A_PER_SECOND + 0.02 * 4.5e12 / 818e9
    assert run.cmp_projection(RATES) == pytest.approx(1024 / 0.4 * 0.08 / projected_step)
    assert PrefillRun(297, 0.1).cmp_projection(RATES) is None
    assert PrefillRun(297, 0.1).gemm_share_of_peak(RATES) is None
    assert kernel_family("gemm_q8_64_64k2p") == "GEMM" and kernel_family("gemv_q8_fused_s4") == "GEMV"


def test_report_compares_with_llama_cpp_and_lists_the_published_cmp_figures() -> None:
    families = [FamilyTime("GEMM", 10, 0.06, 0), FamilyTime("GDN", 5, 0.02, 0)]
    runs = [PrefillRun(1160, 0.5, families, int(4.8e12 * 0.06)), PrefillRun(297, 0.2)]
    llama = [LlamaResult(1160, 0, 0, 2000.0, "b1 (abc)"), LlamaResult(0, 128, 0, 50.0, "b1 (abc)")]
    text = "\n".join(format_prefill("m.gguf", "H200", runs, llama, "9B", RATES))
    assert "streaming read 4500 GB/s, dp4a 128.0 TOPS" in text
    assert "    1160     0.50    2320.0    2000.0       1.16      3.8%" in text
    assert "     297     0.20    1485.0         -          -         -               -" in text
    assert "llama.cpp: 297: 199" in text and "qengine: 297: 594" in text
    assert "last 256-token step of the 1160-token prompt: 80.00 ms" in text
    assert "a projection, not a measurement" in text
    payload = prefill_json("m.gguf", "H200", runs, llama, "9B", RATES)
    first = payload["runs"][0]
    assert (first["tokens"], first["tok_s"], first["llama_cpp_tok_s"], first["gemm_share_of_dp4a_peak"]) == (
        1160,
        2320.0,
        2000.0,
        0.0375,
    )
    projection = runs[0].cmp_projection(RATES)
    assert projection is not None and first["cmp_projection_tok_s"] == round(projection, 1)
    assert payload["runs"][1]["llama_cpp_tok_s"] is None and payload["runs"][1]["families"] == []
