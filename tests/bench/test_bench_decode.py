"""The decode benchmark's arithmetic and reports (CPU): bytes per step, limits, projections, kernel families,
llama-bench's JSON, and the command's refusal without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cmpchat.bench.decode import DecodeRun
from cmpchat.bench.kernel_families import FamilyTime, family_times, kernel_family
from cmpchat.bench.limits import (
    CMP_READ_BANDWIDTH,
    cmp_projection,
    limit_tokens_per_second,
    step_bytes,
    weight_bytes_per_step,
)
from cmpchat.bench.llama_cpp import decode_command, parse_llama_bench_json
from cmpchat.bench.model_files import bench_model_path
from cmpchat.bench.report import DecodeReport, decode_json, format_decode
from cmpchat.cli import main
from cmpchat.errors import CmpchatError
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile


def test_weight_bytes_count_every_layer_and_the_lm_head_once(tiny_model_path: Path) -> None:
    model = ModelFile(tiny_model_path)
    config = ModelConfig.from_model_file(model)
    layers = sum(i.n_bytes for n, i in model.tensors.items() if n.startswith("blk."))
    head = model.tensor_info("output.weight" if model.has_tensor("output.weight") else "token_embd.weight").n_bytes
    norm = model.tensor_info("output_norm.weight").n_bytes
    assert weight_bytes_per_step(model, config) == layers + head + norm


def test_step_bytes_limit_and_projection(tiny_model_path: Path) -> None:
    config = ModelConfig.from_model_file(ModelFile(tiny_model_path))
    at_zero = step_bytes(1000, config, 0)
    at_4k = step_bytes(1000, config, 4096, batch=2)
    assert at_zero.kv_cache == 0 and at_zero.recurrent_state == 2 * config.recurrent_state_bytes()
    assert at_4k.kv_cache == 2 * 4096 * config.kv_bytes_per_token()
    assert at_4k.recurrent_state == 2 * at_zero.recurrent_state
    assert limit_tokens_per_second(2e12, 1_000_000_000) == pytest.approx(2000)
    assert limit_tokens_per_second(2e12, 1_000_000_000, batch=4) == pytest.approx(8000)
    # Half the limit on the H200 projects to half the CMP's own limit.
    assert cmp_projection(0.5, 1_000_000_000) == pytest.approx(0.5 * CMP_READ_BANDWIDTH / 1e9)


def test_kernel_families_group_by_name() -> None:
    assert kernel_family("gemv_q8_fused") == "GEMV"
    assert kernel_family("gemv_q8_t4") == "GEMV"
    assert kernel_family("attention_partial_g4_d256_w4_u4") == "attention"
    assert kernel_family("qk_norm_rope") == "attention"
    assert kernel_family("gdn_recurrent_step") == "GDN"
    assert kernel_family("rms_norm_quantize_keep") == "norm+quantize"
    assert kernel_family("something_new") == "other"
    times = family_times(["gemv_q8_fused", "gdn_conv_step", "gemv_q8_fused"], [2e-6, 1e-6, 3e-6], {"GEMV": 10_000})
    assert [(f.family, f.launches) for f in times] == [("GEMV", 2), ("GDN", 1)]
    assert times[0].seconds == pytest.approx(5e-6) and times[0].bandwidth == pytest.approx(2e9)
    assert times[1].bandwidth is None


LLAMA_OUTPUT = """ggml_cuda_init: found 1 CUDA devices:
[
  {"build_commit": "0c1e5709", "build_number": 7000, "model_filename": "m.gguf", "n_prompt": 0, "n_gen": 128,
   "n_depth": 0, "avg_ts": 201.5, "stddev_ts": 0.4},
  {"build_commit": "0c1e5709", "build_number": 7000, "model_filename": "m.gguf", "n_prompt": 0, "n_gen": 128,
   "n_depth": 4096, "avg_ts": 190.25, "stddev_ts": 0.3}
]
"""


def test_llama_bench_json_is_parsed_after_its_log_lines() -> None:
    results = parse_llama_bench_json(LLAMA_OUTPUT)
    assert [(r.depth, r.tokens_per_second) for r in results] == [(0, 201.5), (4096, 190.25)]
    assert results[0].build == "7000 (0c1e5709)"
    with pytest.raises(CmpchatError, match="JSON"):
        parse_llama_bench_json("error: failed to load model")
    command = decode_command(Path("llama-bench"), Path("m.gguf"), [0, 4096])
    assert command[command.index("-d") + 1] == "0,4096" and "-fa" in command and "json" in command


def _report() -> DecodeReport:
    config_bytes = step_bytes(9_000_000_000, _config_stub(), 0)
    families = [FamilyTime("GEMV", 129, 0.0029, 9_000_000_000, in_replay=0.0027),
                FamilyTime("GDN", 48, 0.0003, 0, in_replay=0.00002)]  # fmt: skip
    run = DecodeRun(context=0, batch=1, tokens_per_second=300.0, bytes=config_bytes, limit=500.0,
                    step_seconds=1 / 300, replay_seconds=0.0032, families=families)  # fmt: skip
    batched = DecodeRun(context=0, batch=4, tokens_per_second=900.0, bytes=config_bytes, limit=1900.0,
                        step_seconds=4 / 900)  # fmt: skip
    llama = parse_llama_bench_json(LLAMA_OUTPUT)
    return DecodeReport("random-qwen35-9B-q8_0.gguf", "NVIDIA H200", 4.5e12, [run, batched], llama, shape="9B",
                        early_launch=True)  # fmt: skip


def _config_stub() -> ModelConfig:
    from cmpchat.model.builder import MODEL_SHAPES
    from cmpchat.model.config import LayerKind

    shape = MODEL_SHAPES["9B"]
    kinds = tuple(LayerKind.ATTENTION if shape.is_attention(i) else LayerKind.RECURRENT for i in range(32))
    return ModelConfig(
        name="9B", vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, ffn_size=shape.ffn_size,
        context_length=shape.context_length, rms_eps=1e-6, layer_kinds=kinds, num_mtp_layers=0,
        tied_embeddings=False, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=256,
        rope_dims=64, rope_theta=1e7, rope_sections=(11, 11, 10, 0), conv_kernel=4, num_k_heads=16,
        num_v_heads=32, k_head_dim=128, v_head_dim=128,
    )  # fmt: skip


def test_report_shows_ratios_llama_and_the_labelled_projection() -> None:
    report = _report()
    text = "\n".join(format_decode(report))
    assert "60.0%" in text  # 300 of a 500 tok/s limit
    assert "201.5" in text and "1.49" in text  # llama.cpp at context 0, ours / llama
    assert "projection" in text and "46.6" in text and "70.4" in text
    assert "early launch on" in text
    # Each family's own time and what it adds to the replay, which overlap makes smaller.
    assert "   2900 µs" in text and "adds    2700 µs" in text and "adds      20 µs" in text
    data = decode_json(report)
    json.dumps(data)
    assert data["early_launch"] is True
    assert [f["in_replay_us"] for f in data["runs"][0]["families"]] == [2700.0, 20.0]
    first = data["runs"][0]
    assert first["ratio_of_limit"] == pytest.approx(0.6) and first["llama_cpp_tok_s"] == 201.5
    assert data["runs"][1]["cmp_projection_tok_s"] is None  # projections are for batch 1 only


def test_the_structured_run_is_reported_against_the_plain_one_not_in_the_table() -> None:
    plain = _report()
    structured = DecodeRun(context=0, batch=1, tokens_per_second=285.0, bytes=plain.runs[0].bytes, limit=500.0,
                           step_seconds=1 / 285, structured=True)  # fmt: skip
    report = DecodeReport(plain.model, plain.gpu, plain.read_bandwidth, [*plain.runs, structured], plain.llama)
    lines = format_decode(report)
    assert not any(" 285.0 " in line for line in lines[:5])  # the table holds the plain runs only
    assert any("under a JSON schema" in line and "285.0 tok/s, 95.0% of the plain reply's" in line for line in lines)
    assert [run["structured"] for run in decode_json(report)["runs"]] == [False, False, True]


def test_bench_model_path_takes_a_file_or_refuses_clearly(tmp_path: Path, tiny_model_path: Path) -> None:
    assert bench_model_path(str(tiny_model_path), tmp_path) == tiny_model_path
    with pytest.raises(CmpchatError, match="neither a model shape"):
        bench_model_path("13B", tmp_path)


def test_bench_without_a_gpu_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "decode", "9B"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "needs an NVIDIA GPU" in error


def test_profile_attribution_adds_up_to_the_replay() -> None:
    from cmpchat.cudart.profile import LaunchTimings

    timings = LaunchTimings(names=("a", "b", "c"), per_launch=(5e-6, 3e-6, 1e-6), replay=6e-6)
    attributed = timings.attributed()
    assert attributed == pytest.approx((4e-6, 2e-6, 0.0))  # 1 µs of timer per launch taken off
    assert sum(attributed) == pytest.approx(timings.replay)


def test_backend_memory_plan_is_what_loading_would_allocate(tiny_model_path: Path) -> None:
    from cmpchat.backends.gpu.memory_plan import MIN_CONTEXT, RESERVE_BYTES
    from cmpchat.backends.gpu.model import CudaBackend

    model = ModelFile(tiny_model_path)
    config = ModelConfig.from_model_file(model)
    (plan,) = CudaBackend.memory_plans(model, config, sequences=2, context=config.context_length)
    assert plan.sequences == 2 and plan.context_limit == config.context_length <= plan.pool_tokens
    with pytest.raises(CmpchatError, match="needs .* GiB on the GPU"):
        # Room for everything but a pool of the shortest context worth running.
        fixed = plan.total - plan.kv_pool + RESERVE_BYTES
        short = fixed + (MIN_CONTEXT - 1) * plan.kv_bytes_per_token
        CudaBackend.memory_plans(model, config, sequences=2, context=config.context_length, gpu_mem=short)


def test_a_failed_build_leaves_no_partial_file(tmp_path: Path) -> None:
    from cmpchat.model.builder import MODEL_SHAPES, build_model

    def broken_tokenizer(writer: object) -> None:
        raise OSError(28, "No space left on device")

    target = tmp_path / "model.gguf"
    with pytest.raises(OSError):
        build_model(target, MODEL_SHAPES["demo"], add_tokenizer=broken_tokenizer, chat_template=None)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_bench_folder_is_one_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(CmpchatError, match="cannot write .*pass --folder"):
        bench_model_path("0.8B", blocker)


def test_a_pipelines_decode_is_projected_from_each_stage_alone() -> None:
    from cmpchat.bench.limits import CMP_READ_BANDWIDTH
    from cmpchat.bench.pipeline_schedule import HostLink

    config_bytes = step_bytes(9_000_000_000, _config_stub(), 0)
    run = DecodeRun(context=0, batch=1, tokens_per_second=250.0, bytes=config_bytes, limit=500.0,
                    step_seconds=0.004, replay_seconds=0.0036, stage_replays=[0.0012] * 3, hidden_size=4096)  # fmt: skip
    link = HostLink()
    scale = 4.5e12 / CMP_READ_BANDWIDTH
    hop = link.seconds(4 * 4096)
    expected = 1 / (3 * 0.0012 * scale + 2 * 2 * hop + 2 * link.seconds(8) + (0.004 - 0.0036))
    assert run.pipeline_projection(4.5e12) == pytest.approx(expected)
    one_stage = DecodeRun(context=0, batch=1, tokens_per_second=250.0, bytes=config_bytes, limit=500.0,
                          step_seconds=0.004, stage_replays=[0.0036])  # fmt: skip
    assert one_stage.pipeline_projection(4.5e12) is None
    report = DecodeReport("m.gguf", "NVIDIA H200", 4.5e12, [run], [], early_launch=True)
    assert "projected to 3 CMP cards" in "\n".join(format_decode(report))
    assert decode_json(report)["runs"][0]["pipeline_projection_tok_s"] == pytest.approx(expected, abs=0.05)


def test_a_pipelines_batch_is_projected_with_one_group_a_stage_in_flight() -> None:
    from cmpchat.bench.limits import CMP_READ_BANDWIDTH
    from cmpchat.bench.pipeline_schedule import HostLink, decode_seconds, grouped_decode_seconds

    config_bytes = step_bytes(9_000_000_000, _config_stub(), 0, 4)
    run = DecodeRun(context=0, batch=4, tokens_per_second=900.0, bytes=config_bytes, limit=2000.0,
                    step_seconds=0.0044, stage_replays=[0.0013] * 3, hidden_size=4096)  # fmt: skip
    scale = 4.5e12 / CMP_READ_BANDWIDTH
    stages, hop, link = [0.0013 * scale] * 3, 4 * 4096 * 4, HostLink()
    outside = 0.0044 - 3 * 0.0013
    projected = run.groups_projection(4.5e12)
    assert projected is not None
    aggregate, one_group = projected
    assert one_group == pytest.approx(4 / (decode_seconds(stages, hop, link, ids_bytes=16) + outside))
    assert aggregate == pytest.approx(12 / (grouped_decode_seconds(stages, 3, hop, link, ids_bytes=16) + outside))
    assert 2.5 < aggregate / one_group < 3.0  # three cards, each busy with one group's step most of a round
    assert run.pipeline_projection(4.5e12) is None  # that one is batch 1's
    report = DecodeReport("m.gguf", "NVIDIA H200", 4.5e12, [run], [], early_launch=True)
    assert "3 groups of 4 in flight" in "\n".join(format_decode(report))
    assert decode_json(report)["runs"][0]["groups_in_flight_projection_tok_s"] == [
        pytest.approx(aggregate, abs=0.05),
        pytest.approx(one_group, abs=0.05),
    ]


def test_each_released_size_runs_in_each_mix_and_a_file_once(tiny_model_path: Path) -> None:
    from cmpchat.cli import build_parser
    from cmpchat.commands.bench import bench_runs

    args = build_parser().parse_args(["bench", "decode", "9B", str(tiny_model_path), "--mix", "Q8_0", "Q4_K_M"])
    assert bench_runs(args) == [("9B", "Q8_0"), ("9B", "Q4_K_M"), (str(tiny_model_path), "Q8_0")]
    assert bench_runs(build_parser().parse_args(["bench", "prefill", "27B"])) == [("27B", "Q8_0")]
