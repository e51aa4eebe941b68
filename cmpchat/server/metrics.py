"""`/metrics` in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cmpchat.backends.base import StageSummary
from cmpchat.engine.engine import Engine
from cmpchat.engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class _Metric:
    name: str
    kind: str
    help: str
    samples: tuple[tuple[str, float], ...]
    """(label text, value) pairs; label text is "" or `{key="value"}`."""


def render_metrics(engine: Engine[Any] | None, *, slots: int) -> str:
    """The metrics page; an engine of None (model not loaded yet) reports zeros."""
    stats = engine.stats if engine is not None else EngineStats()
    running = engine.running if engine is not None else 0
    waiting = engine.waiting if engine is not None else 0
    cached_states = len(engine.prefix_cache) if engine is not None else 0
    pool = engine.backend.pool if engine is not None else None
    free_pages = pool.free_pages if pool is not None else 0
    total_pages = pool.total_pages if pool is not None else 0
    finished = dict(stats.finished)
    metrics = [
        _gauge("model_loaded", "1 once the model is loaded and the server takes requests", float(engine is not None)),
        _gauge("slots", "sequences that can be generated together", slots),
        _gauge("requests_running", "requests holding a slot", running),
        _gauge("requests_queued", "requests waiting for a slot", waiting),
        _counter("prompt_tokens_total", "prompt tokens prefilled (not counting reused ones)", stats.prompt_tokens),
        _counter("prompt_seconds_total", "seconds spent prefilling prompts", stats.prompt_seconds),
        _gauge("prompt_tokens_per_second", "prompt tokens per second of prefill time", stats.prompt_tokens_per_second),
        _counter("prompt_tokens_cached_total", "prompt tokens resumed from saved states", stats.cached_prompt_tokens),
        _counter("decode_steps_total", "batched decode steps", stats.decode_steps),
        _counter("decode_seconds_total", "seconds spent in decode steps", stats.decode_seconds),
        _gauge(
            "decode_tokens_per_second",
            "tokens per second of decode time, all sequences of a step together",
            stats.decode_tokens_per_second,
        ),
        _counter("tokens_generated_total", "tokens generated and served", stats.generated_tokens),
        _Metric(
            "cmpchat_requests_finished_total",
            "counter",
            "requests finished, by finish reason",
            tuple((f'{{reason="{reason}"}}', float(count)) for reason, count in sorted(finished.items())),
        ),
        _counter("requests_failed_total", "requests the engine could not finish", stats.failed),
        _gauge("prefix_cache_states", "saved sequence states kept for prefix reuse", cached_states),
        _counter(
            "preemptions_total", "times a request gave back its KV pages to others and resumed later", stats.preemptions
        ),  # fmt: skip
        _gauge("kv_pages_free", "free pages of the shared KV cache", free_pages),
        _gauge("kv_pages", "pages of the shared KV cache", total_pages),
        *_stage_metrics(engine.backend.stage_summaries() if engine is not None else None),
    ]
    lines: list[str] = []
    for metric in metrics:
        lines.append(f"# HELP {metric.name} {metric.help}")
        lines.append(f"# TYPE {metric.name} {metric.kind}")
        lines.extend(f"{metric.name}{labels} {_number(value)}" for labels, value in metric.samples)
    return "\n".join(lines) + "\n"


def _stage_metrics(stages: list[StageSummary] | None) -> list[_Metric]:
    """Per pipeline stage (labelled by stage and GPU): its layers and what it has handed to the next stage."""
    if not stages:
        return []

    def per_stage(name: str, kind: str, help_text: str, value: Callable[[StageSummary], float]) -> _Metric:
        samples = tuple((f'{{stage="{s.index}",gpu="{s.gpu_index}"}}', float(value(s))) for s in stages)
        return _Metric(f"cmpchat_stage_{name}", kind, help_text, samples)

    return [
        per_stage("first_layer", "gauge", "the first layer a pipeline stage runs", lambda s: s.layers.start),
        per_stage("last_layer", "gauge", "the last layer a pipeline stage runs", lambda s: s.layers.stop - 1),
        per_stage("handoffs_total", "counter", "hidden states handed to the next stage", lambda s: s.handoffs),
        per_stage("handoff_bytes_total", "counter", "bytes handed to the next stage", lambda s: s.handoff_bytes),
    ]


def _gauge(name: str, help_text: str, value: float) -> _Metric:
    return _Metric(f"cmpchat_{name}", "gauge", help_text, (("", float(value)),))


def _counter(name: str, help_text: str, value: float) -> _Metric:
    return _Metric(f"cmpchat_{name}", "counter", help_text, (("", float(value)),))


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)
