"""`cuda/engine_marks.py` (issue 25's engine marks, a GPU-machine script) end to end on the CPU: every part on the
tiny model at tiny sizes through the numpy reference, and the arithmetic of the parts only the GPU runs in full
(the client's window, the verdicts)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "cuda" / "engine_marks.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_marks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_every_part_runs_on_the_tiny_model(tiny_model_path: Path, tmp_path: Path) -> None:
    results = tmp_path / "marks"
    command = [sys.executable, str(SCRIPT), "--model", str(tiny_model_path), "--backend", "cpu", "--scale", "0.05",
               "--results", str(results)]  # fmt: skip
    finished = subprocess.run(command, cwd=SCRIPT.parents[1], capture_output=True, text=True, timeout=240, check=False)
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert finished.stdout.startswith("engine marks (issue 25):")
    report = json.loads((results / "engine_marks.json").read_text())
    parts: dict[str, Any] = report["parts"]
    assert set(parts) == {"serve", "pool", "app"}
    assert all(part["ok"] and part["error"] is None for part in parts.values()), parts
    for name in parts:
        assert (results / f"{name}.json").exists()

    serve = parts["serve"]
    assert serve["bench"] == {"skipped": "cmpchat bench needs a GPU"} and serve["ratio_to_bench"] is None
    assert len(serve["streams"]) == 4 and all(s["error"] is None for s in serve["streams"])
    assert serve["finish_reasons"] == ["length"] * 4  # max_tokens is reached (the tiny model never ends)
    assert serve["usage_completion_tokens"] == [serve["max_tokens"]] * 4
    assert all(0 < chunks <= serve["max_tokens"] for chunks in serve["chunks_with_text"])
    assert serve["window_tokens"] > 0 and serve["window_seconds"] > 0 and serve["client_tok_s"] > 0
    assert serve["server_stopped"].startswith("SIGINT")

    pool = parts["pool"]
    assert pool["pool_tokens"] == pool["pool_pages"] * pool["page_tokens"] > 0
    long = pool["long"]
    assert long["admitted"] and long["short_running_at_admission"] == 15
    assert long["finish_reason"] == "length" and long["generated"] == long["max_tokens"]
    assert long["prompt_tokens"] > 2000 and long["prompt_tok_s"] > 0
    refusal = pool["refusal"]
    assert refusal["refused"] and refusal["one_line"] and "KV pool" in refusal["message"]
    grow = pool["growing"]
    assert grow["completed"] == grow["requests"] == 16
    assert grow["preemptions"] > 0 and max(grow["admissions"]) > 1
    # The reference backend resumes exactly: every reply equals its run alone, token for token.
    assert grow["compared"] == grow["identical"] == 16 and grow["compared_by"] == "token ids"

    app = parts["app"]
    assert app["first_turn"]["prompt_tokens"] == app["conversation_tokens"] >= 400
    # The second turn resumed where its prompt parts from the first's and read only what is new.
    assert 0 < app["prompt_tokens"] == app["new_tokens"] < app["prompt_length"] // 2
    assert app["cached_tokens"] == app["prompt_length"] - app["prompt_tokens"]
    assert app["ttft_s"] > 0 and app["prefill_new_s"] > 0 and app["prefill_new_after_context_s"] > 0
    assert app["ratio"] == round(app["ttft_s"] / app["prefill_new_s"], 3)

    rows = {(row["part"], row["what"]): row for row in report["marks"]}
    assert rows[("pool", "preemptions")]["passed"] is True
    assert rows[("pool", "tokens equal to the run alone")]["passed"] is True
    assert not any(row["what"] == "part failed" for row in report["marks"])


def test_the_client_window_runs_from_the_last_first_token_to_the_first_finish() -> None:
    marks = load_script()
    streams = []
    for index, (first, finish) in enumerate([(1.0, 3.0), (1.5, 3.5), (1.2, 4.0), (1.1, 3.2)]):
        stream = marks.Stream(index, sent_at=0.0, finish_reason="length")
        stream.chunks = [first + 0.1 * k for k in range(int(round((finish - first) / 0.1)) + 1)]
        stream.finished_at = stream.chunks[-1]
        stream.usage = {"completion_tokens": len(stream.chunks)}
        streams.append(stream)
    result = marks.aggregate(streams)
    # From 1.5 s (the last first token) to 3.0 s (the first finish): 15 chunks after 1.5 in each stream.
    assert result["window_seconds"] == 1.5
    assert result["window_tokens"] == 4 * 15
    assert result["client_tok_s"] == 40.0
    assert result["chunks_match_usage"] and result["client_tok_s_usage_scaled"] == 40.0


def test_the_verdicts_of_a_gpu_report() -> None:
    marks = load_script()
    report: dict[str, Any] = {
        "backend": "cuda",
        "parts": {
            "serve": {
                "ok": True,
                "client_tok_s": 950.0,
                "bench_tok_s": 1000.0,
                "ratio_to_bench": 0.95,
                "finish_reasons": ["length"] * 4,
            },
            "pool": {
                "ok": True,
                "pool_tokens": 180_000,
                "pool_tokens_printed": True,
                "warning": "warning: --ctx 262144 exceeds ...",
                "long": {"prompt_tokens": 100_000, "admitted": True, "finish_reason": "length"},
                "refusal": {"refused": True, "one_line": True, "message": "the prompt is ..."},
                "growing": {
                    "requests": 16,
                    "completed": 16,
                    "preemptions": 9,
                    "compared": 16,
                    "identical": 13,
                    "first_differences": {"2": 700},
                },
            },
            "app": {"ok": False, "error": "out of time during the second turn", "ttft_s": None},
        },
    }
    rows = {(row["part"], row["what"]): row["passed"] for row in marks.marks(report)}
    assert rows[("serve", "client / bench")] is True
    assert rows[("pool", "pool tokens (16 GiB)")] is True
    assert rows[("pool", "context > pool warning")] is True
    assert rows[("pool", "100000-token request beside 15")] is True
    assert rows[("pool", "tokens equal to the run alone")] is None  # on the GPU the reader judges
    assert rows[("app", "part failed")] is False
    report["parts"]["serve"]["finish_reasons"] = ["length", "stop", "length", "length"]
    rows = {(row["part"], row["what"]): row["passed"] for row in marks.marks(report)}
    assert rows[("serve", "client / bench")] is False  # the mark wants every reply to end by length
    assert "FAIL" in marks.format_table({**report, "model": "m.gguf", "scale": 1.0, "marks": marks.marks(report)})
