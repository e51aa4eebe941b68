"""/metrics per pipeline stage: each stage's layers and hand-offs, labelled by stage and GPU."""

from __future__ import annotations

import types

from prometheus_client.parser import text_string_to_metric_families

from cmpchat.backends.base import StageSummary
from cmpchat.engine.stats import EngineStats
from cmpchat.server.metrics import render_metrics


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def engine_with(stages: list[StageSummary] | None) -> types.SimpleNamespace:
    pool = types.SimpleNamespace(free_pages=3, total_pages=8)
    backend = types.SimpleNamespace(pool=pool, stage_summaries=lambda: stages)
    return types.SimpleNamespace(stats=EngineStats(), running=0, waiting=0, prefix_cache=[], backend=backend)


def test_every_stage_reports_its_layers_and_hand_offs():
    stages = [StageSummary(0, 0, "GPU-a", range(0, 22), 5, 5 * 20_480), StageSummary(1, 1, "", range(22, 64), 0, 0)]
    found = families(render_metrics(engine_with(stages), slots=1))  # type: ignore[arg-type]
    first = {(s.labels["stage"], s.labels["gpu"]): s.value for s in found["cmpchat_stage_first_layer"].samples}
    last = {s.labels["stage"]: s.value for s in found["cmpchat_stage_last_layer"].samples}
    handed = {s.labels["stage"]: s.value for s in found["cmpchat_stage_handoff_bytes"].samples}
    assert first == {("0", "0"): 0, ("1", "1"): 22} and last == {"0": 21, "1": 63}
    assert handed == {"0": 5 * 20_480, "1": 0}


def test_a_backend_without_stages_adds_no_stage_metrics():
    nothing: tuple[list[StageSummary] | None, ...] = (None, [])
    for stages in nothing:
        found = families(render_metrics(engine_with(stages), slots=1))  # type: ignore[arg-type]
        assert not any(name.startswith("cmpchat_stage_") for name in found)
    assert not any(name.startswith("cmpchat_stage_") for name in families(render_metrics(None, slots=1)))
