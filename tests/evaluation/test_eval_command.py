"""`cmpchat eval` on the trained model at short contexts (CPU reference backend)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cmpchat.cli import main

MODEL = str(Path(__file__).parent.parent / "fixtures" / "trained" / "trained.q8_0.gguf")
# Text the model never saw: this repository's own code (the corpus holds only installed packages).
TEXT = Path(__file__).parents[2] / "cmpchat" / "evaluation" / "quality.py"
UNIGRAM_PERPLEXITY = json.loads((Path(MODEL).parent / "manifest.json").read_text())["corpus"]["unigram_heldout_ppl"]


def eval_json(capsys, *args: str) -> dict:
    assert main(["eval", MODEL, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_perplexity_and_a_configuration_against_itself(capsys):
    result = eval_json(
        capsys, "--text", str(TEXT), "--ctx", "256", "--chunks", "4",
        "--base", "backend=cpu", "--test", "backend=cpu", "--test", "backend=cpu,mirror_gpu=1",
    )  # fmt: skip
    text = result["text"]
    assert text["windows"] == 4 and text["window_tokens"] == 256 and text["scored_tokens"] == 4 * 127
    assert 1 < text["perplexity"] < UNIGRAM_PERPLEXITY / 3
    same, mirrored = text["tests"]["backend=cpu (2)"], text["tests"]["backend=cpu,mirror_gpu=1"]
    assert same["kl_mean"] == same["kl_p99"] == same["kl_max"] == 0.0
    assert same["top1_agreement"] == 1.0 and same["perplexity"] == text["perplexity"]
    # int8 activations and an fp16 KV cache move the distribution a little, never far
    assert 0.0 < mirrored["kl_mean"] <= mirrored["kl_p99"] <= mirrored["kl_max"] < 0.05
    assert mirrored["top1_agreement"] > 0.9
    assert abs(mirrored["perplexity"] / text["perplexity"] - 1) < 0.02


def test_the_table_names_every_configuration(capsys):
    assert main(["eval", MODEL, "--text", str(TEXT), "--ctx", "128", "--chunks", "1", "--base", "backend=cpu",
                 "--test", "backend=cpu,mirror_gpu=1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "perplexity" in out and "KL p99" in out and "backend=cpu,mirror_gpu=1" in out and "%" in out


def test_a_needle_cell_of_twenty_trials(capsys):
    result = eval_json(capsys, "--needle", "--lengths", "1024", "--depths", "50", "--base", "backend=cpu")
    grid = result["needle"]["backend=cpu"]
    assert grid["lengths"] == [1024] and grid["depths"] == [0.5] and grid["trials"] == 20
    accuracy = grid["accuracy"][0][0]
    assert 0.0 <= accuracy <= 1.0 and (accuracy * 20).is_integer()


def test_kv_formats_against_f16(capsys):
    result = eval_json(
        capsys, "--text", str(TEXT), "--ctx", "128", "--chunks", "1", "--base", "backend=cpu,kv=f16",
        "--test", "backend=cpu,kv=q8", "--test", "backend=cpu,kv=tq3", "--test", "backend=cpu,kv=q4_0",
    )  # fmt: skip
    kl = {name: d["kl_mean"] for name, d in result["text"]["tests"].items()}
    assert list(kl) == ["backend=cpu,kv=q8", "backend=cpu,kv=tq3", "backend=cpu,kv=q4_0"]
    assert 0 < kl["backend=cpu,kv=q8"] < kl["backend=cpu,kv=q4_0"] < kl["backend=cpu,kv=tq3"] < 0.1


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "nothing to measure"),
        (["--text", "missing.txt"], "cannot read the text file"),
        (["--needle", "--base", "sparse=1"], "unknown key 'sparse'"),
        (["--needle", "--base", "kv=tq2"], "bad value 'tq2' for kv"),
        (["--needle", "--base", "mirror_gpu=maybe"], "bad value 'maybe' for mirror_gpu"),
        (["--needle", "--lengths", "64"], "is too short"),
        (["--needle", "--lengths", "1024", "--depths", "150"], "outside 0..1"),
        (["--needle", "--lengths", "a,b"], "whole numbers"),
    ],
)
def test_bad_input_is_one_error_line(args, fragment, capsys):
    base = [] if "--base" in args else ["--base", "backend=cpu"]
    assert main(["eval", MODEL, *base, *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("cmpchat: error: ") and fragment in err[-1]
