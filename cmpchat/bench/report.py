"""Text and JSON forms of the decode and prefill benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

from cmpchat.bench.decode import DecodeRun
from cmpchat.bench.limits import CMP_READ_BANDWIDTH, PUBLISHED_CMP_9B_DECODE
from cmpchat.bench.llama_cpp import LlamaResult
from cmpchat.bench.pipeline_schedule import CMP_LINK_BYTES_PER_SECOND, COPY_LATENCY_SECONDS
from cmpchat.bench.prefill import PUBLISHED_CMP_9B_PREFILL, PrefillRates, PrefillRun


@dataclass(frozen=True)
class DecodeReport:
    model: str
    gpu: str
    read_bandwidth: float
    runs: list[DecodeRun]
    llama: list[LlamaResult]
    shape: str | None = None
    """The released size the file has the shapes of, when it is a benchmark file."""
    early_launch: bool = False
    """Whether decode kernels were launched early (programmatic dependent launch: sm_90+, `raw_launch`)."""

    def llama_at(self, context: int) -> LlamaResult | None:
        for result in self.llama:
            if result.generated_tokens and result.depth == context:
                return result
        return None


def format_decode(report: DecodeReport) -> list[str]:
    lines = [
        f"{report.model} on {report.gpu}: streaming read {report.read_bandwidth / 1e9:.0f} GB/s (measured now); "
        f"early launch {'on' if report.early_launch else 'off'}",
        f"{'context':>8} {'batch':>5} {'tok/s':>8} {'limit':>8} {'of limit':>8} {'llama.cpp':>9} {'ours/llama':>10}"
        f" {'CMP projection':>15}",
    ]
    for run in report.runs:
        if run.structured:
            continue
        llama = report.llama_at(run.context) if run.batch == 1 else None
        llama_text = f"{llama.tokens_per_second:9.1f}" if llama else f"{'-':>9}"
        versus = f"{run.tokens_per_second / llama.tokens_per_second:10.2f}" if llama else f"{'-':>10}"
        projection = f"{run.cmp_projection:11.1f} tok/s" if run.batch == 1 else f"{'-':>15}"
        lines.append(
            f"{run.context:8d} {run.batch:5d} {run.tokens_per_second:8.1f} {run.limit:8.1f} {run.ratio:8.1%} "
            f"{llama_text} {versus} {projection}"
        )
    lines.append(
        f"limit = bytes read per step (Q8_0 weights with scales + KV cache at that context + recurrent state read "
        f"and written) / streaming read. CMP projection = ratio x {CMP_READ_BANDWIDTH / 1e9:.0f} GB/s / bytes "
        "per token: a projection, not a measurement."
    )
    lines += _format_structured(report.runs)
    for run in report.runs:
        pipeline = run.pipeline_projection(report.read_bandwidth)
        if pipeline is not None:
            steps = " / ".join(f"{replay * 1e3:.2f}" for replay in run.stage_replays)
            lines.append(
                f"context {run.context}, {len(run.stage_replays)} stages (each step replayed alone: {steps} ms): "
                f"projected to {len(run.stage_replays)} CMP cards {pipeline:.1f} tok/s (each stage scaled by the "
                f"read bandwidths, run in turn with each hop's copies: cmpchat/bench/pipeline_schedule.py)"
            )
        groups = run.groups_projection(report.read_bandwidth)
        if groups is not None:
            stages = len(run.stage_replays)
            steps = " / ".join(f"{replay * 1e3:.2f}" for replay in run.stage_replays)
            lines.append(
                f"context {run.context}, {stages} stages, batch {run.batch} (steps alone: {steps} ms): projected to "
                f"{stages} CMP cards, {stages} groups of {run.batch} in flight {groups[0]:.1f} tok/s = "
                f"{groups[0] / groups[1]:.2f}x one group of {run.batch} through them ({groups[1]:.1f} tok/s)"
            )
    if report.shape == "9B":
        published = ", ".join(f"{name} {value} tok/s" for name, value in PUBLISHED_CMP_9B_DECODE.items())
        lines.append(f"published 9B Q8_0 decode on one CMP 100-210: {published}")
    if report.llama:
        lines.append(
            f"llama.cpp: llama-bench tg128, FlashAttention on, all layers on the GPU, build {report.llama[0].build}"
        )
    for run in report.runs:
        if run.families:
            lines += _format_families(run)
    return lines


def _format_structured(runs: list[DecodeRun]) -> list[str]:
    """The structured run against the plain batch-1 run at its context, both from this run of the benchmark."""
    lines = []
    for run in (r for r in runs if r.structured):
        plain = next((r for r in runs if r.batch == 1 and r.context == run.context and not r.structured), None)
        versus = f", {run.tokens_per_second / plain.tokens_per_second:.1%} of the plain reply's" if plain else ""
        lines.append(
            f"context {run.context}, batch 1 under a JSON schema (bench/decode.py's STRUCTURED_SCHEMA): "
            f"{run.tokens_per_second:.1f} tok/s{versus}"
        )
    return lines


def _format_families(run: DecodeRun) -> list[str]:
    total = sum(f.seconds for f in run.families)
    replay = run.replay_seconds or total
    lines = [
        f"one step at context {run.context}: {run.step_seconds * 1e3:.2f} ms end to end, graph replay "
        f"{replay * 1e3:.2f} ms. Per family: its kernels timed one by one (the timers' own cost taken off), "
        "and what it adds to the replay (the replay against one without its launches; kernels overlap)"
    ]
    for family in run.families:
        bandwidth = family.bandwidth
        rate = f"{bandwidth / 1e9:7.0f} GB/s" if bandwidth else " " * 12
        adds = "" if family.in_replay is None else f" adds {family.in_replay * 1e6:7.0f} µs"
        lines.append(
            f"  {family.family:14} {family.launches:4d} launches {family.seconds * 1e6:9.0f} µs "
            f"{family.seconds / total:6.1%} {rate}{adds}"
        )
    outside = run.step_seconds - replay
    lines.append(f"  {'outside graph':14} {'':14} {outside * 1e6:9.0f} µs (selection, host round trip)")
    return lines


def decode_json(report: DecodeReport) -> dict:
    return {
        "model": report.model,
        "shape": report.shape,
        "gpu": report.gpu,
        "read_bandwidth_GBps": round(report.read_bandwidth / 1e9, 1),
        "early_launch": report.early_launch,
        "runs": [_run_json(run, report) for run in report.runs],
        "llama_cpp": [vars(result) for result in report.llama],
    }


def _run_json(run: DecodeRun, report: DecodeReport) -> dict:
    llama = report.llama_at(run.context) if run.batch == 1 else None
    pipeline = run.pipeline_projection(report.read_bandwidth)
    groups = run.groups_projection(report.read_bandwidth)
    return {
        "context": run.context,
        "batch": run.batch,
        "structured": run.structured,
        "tok_s": round(run.tokens_per_second, 2),
        "limit_tok_s": round(run.limit, 2),
        "ratio_of_limit": round(run.ratio, 4),
        "bytes_per_step": run.bytes.total,
        "step_ms": round(run.step_seconds * 1e3, 4),
        "replay_ms": None if run.replay_seconds is None else round(run.replay_seconds * 1e3, 4),
        "cmp_projection_tok_s": round(run.cmp_projection, 1) if run.batch == 1 else None,
        "stage_replay_ms": [round(replay * 1e3, 4) for replay in run.stage_replays],
        "pipeline_projection_tok_s": None if pipeline is None else round(pipeline, 1),
        "groups_in_flight_projection_tok_s": None if groups is None else [round(value, 1) for value in groups],
        "llama_cpp_tok_s": None if llama is None else llama.tokens_per_second,
        "families": [
            {
                "family": f.family,
                "launches": f.launches,
                "us": round(f.seconds * 1e6, 1),
                "GBps": None if f.bandwidth is None else round(f.bandwidth / 1e9, 1),
                "in_replay_us": None if f.in_replay is None else round(f.in_replay * 1e6, 1),
            }
            for f in run.families
        ],  # fmt: skip
        "kernels": {name: {"launches": n, "us": round(t * 1e6, 1)} for name, (n, t) in run.kernels.items()},
    }


def _llama_prompt(llama: list[LlamaResult], tokens: int) -> LlamaResult | None:
    return next((r for r in llama if r.prompt_tokens == tokens and not r.generated_tokens), None)


def format_prefill(
    model: str, gpu: str, runs: list[PrefillRun], llama: list[LlamaResult], shape: str | None, rates: PrefillRates
) -> list[str]:
    lines = [
        f"{model} on {gpu}: prompt processing; streaming read {rates.read_bandwidth / 1e9:.0f} GB/s, dp4a "
        f"{8 * rates.dp4a_per_second / 1e12:.1f} TOPS (8 ops per dp4a), both measured now",
        f"{'tokens':>8} {'seconds':>8} {'tok/s':>9} {'llama.cpp':>9} {'ours/llama':>10} {'GEMM/dp4a':>9} "
        f"{'CMP projection':>15}",
    ]
    for run in runs:
        other = _llama_prompt(llama, run.tokens)
        theirs = (
            f"{other.tokens_per_second:9.1f} {run.tokens_per_second / other.tokens_per_second:10.2f}"
            if other
            else f"{'-':>9} {'-':>10}"
        )
        share = run.gemm_share_of_peak(rates)
        projection = run.cmp_projection(rates)
        ours = f"{share:9.1%}" if share is not None else f"{'-':>9}"
        ours += f" {projection:9.1f} tok/s" if projection is not None else f" {'-':>15}"
        lines.append(f"{run.tokens:8d} {run.seconds:8.2f} {run.tokens_per_second:9.1f} {theirs} {ours}")
    if llama:
        lines.append(f"llama.cpp: llama-bench pp, FlashAttention on, all layers on the GPU, build {llama[0].build}")
    lines.append(
        "GEMM/dp4a: the GEMMs of the prompt's last 256-token step against the dp4a peak. CMP projection = the "
        "measured time with that step's GEMM time x (dp4a/s here / 4.3e12) and every other family's x (read "
        "bandwidth here / 818 GB/s): a projection, not a measurement."
    )
    if shape == "9B":
        for name, figures in PUBLISHED_CMP_9B_PREFILL.items():
            listed = ", ".join(f"{n}: {value}" for n, value in figures.items())
            lines.append(f"published 9B Q8_0 prompt tok/s on one CMP 100-210, {name}: {listed}")
    for run in runs:
        pipeline = run.pipeline_projection(rates)
        if pipeline is not None:
            steps = " / ".join(f"{sum(f.seconds for f in families) * 1e3:.2f}" for families in run.stage_families)
            busy = " / ".join(f"{b:.0%}" for b in pipeline.busy)
            lines.append(
                f"{run.tokens} tokens, {pipeline.cards} stages (each step timed alone: {steps} ms): projected to "
                f"{pipeline.cards} CMP cards {pipeline.tokens_per_second:.1f} tok/s, {pipeline.speedup:.2f}x one card "
                f"of the same code ({pipeline.one_card_tokens_per_second:.1f}); cards busy {busy}"
            )
    if any(len(run.stage_families) > 1 for run in runs):
        lines.append(
            "Pipeline projection: each stage's step projected as above, replayed in the backend's order with "
            f"{CMP_LINK_BYTES_PER_SECOND / 1e6:.0f} MB/s links and {COPY_LATENCY_SECONDS * 1e6:.0f} µs a copy "
            "(cmpchat/bench/pipeline_schedule.py): a projection, not a measurement."
        )
    for run in runs:
        if run.families:
            total = sum(f.seconds for f in run.families)
            lines.append(f"last 256-token step of the {run.tokens}-token prompt: {total * 1e3:.2f} ms")
            lines += [
                f"  {f.family:14} {f.launches:4d} launches {f.seconds * 1e6:9.0f} µs {f.seconds / total:6.1%}"
                for f in run.families
            ]
    return lines


def prefill_json(
    model: str, gpu: str, runs: list[PrefillRun], llama: list[LlamaResult], shape: str | None, rates: PrefillRates
) -> dict:
    def run_json(run: PrefillRun) -> dict:
        other = _llama_prompt(llama, run.tokens)
        share = run.gemm_share_of_peak(rates)
        projection = run.cmp_projection(rates)
        pipeline = run.pipeline_projection(rates)
        return {
            "tokens": run.tokens,
            "seconds": round(run.seconds, 4),
            "tok_s": round(run.tokens_per_second, 1),
            "llama_cpp_tok_s": None if other is None else other.tokens_per_second,
            "gemm_share_of_dp4a_peak": None if share is None else round(share, 4),
            "cmp_projection_tok_s": None if projection is None else round(projection, 1),
            "families": [
                {"family": f.family, "launches": f.launches, "us": round(f.seconds * 1e6, 1)} for f in run.families
            ],
            "stage_step_us": [round(sum(f.seconds for f in families) * 1e6, 1) for families in run.stage_families],
            "pipeline_projection": None
            if pipeline is None
            else {
                "cards": pipeline.cards,
                "tok_s": round(pipeline.tokens_per_second, 1),
                "one_card_tok_s": round(pipeline.one_card_tokens_per_second, 1),
                "speedup": round(pipeline.speedup, 3),
                "busy": [round(b, 3) for b in pipeline.busy],
            },
        }

    return {
        "model": model,
        "shape": shape,
        "gpu": gpu,
        "read_bandwidth_GBps": round(rates.read_bandwidth / 1e9, 1),
        "dp4a_TOPS": round(8 * rates.dp4a_per_second / 1e12, 2),
        "runs": [run_json(run) for run in runs],
        "llama_cpp": [vars(result) for result in llama],
    }
