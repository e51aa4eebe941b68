"""The command line as a user meets it: replies stream, speeds print, errors are one line."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType

from cmpchat.cli import main
from cmpchat.kv_formats import FORMATS
from cmpchat.model.builder import build_model, matrix_types
from tests.conftest import WIDE_SHAPE, add_byte_vocabulary


def test_run_streams_a_reply_and_prints_speeds(tiny_model_path, capsys):
    assert main(["run", "-m", str(tiny_model_path), "-p", "Hello", "-n", "8", "--temp", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "tok/s" in err and "prompt:" in err and "reply:" in err
    assert gc.get_freeze_count() > 0  # the loaded model stays out of collections (cmpchat.long_lived)


def test_info_describes_the_model(tiny_model_path, capsys):
    assert main(["info", str(tiny_model_path)]) == 0
    out = capsys.readouterr().out
    assert "2 Gated DeltaNet + 2 gated attention" in out
    assert "Q8_0" in out and "KV cache" in out


def test_info_plans_a_pipeline_on_the_cards_gpu_mem_describes(tiny_model_path, capsys):
    assert main(["info", str(tiny_model_path)]) == 0
    assert "no GPU here; give --gpu-mem" in capsys.readouterr().out
    assert main(["info", str(tiny_model_path), "--gpu-mem", "2G", "--gpus", "0,1", "--split", "3,1"]) == 0
    out = capsys.readouterr().out
    assert "2 stage(s)" in out and "GPU 1 (CMP 100-210 (planned)), stage 1" in out
    assert "layers           0-2" in out and "layers           3-3" in out
    assert main(["info", str(tiny_model_path), "--gpu-mem", "2G", "--gpus", "0,1", "--split", "3,2"]) == 0
    assert "gpu plan      --split needs 2 layer counts" in capsys.readouterr().out


def test_info_plans_the_kv_pool_in_a_format(tiny_model_path, capsys):
    assert main(["info", str(tiny_model_path), "--gpu-mem", "2G", "--kv", "q8"]) == 0
    out = capsys.readouterr().out
    assert " tokens q8 at " in out and "context          4096 tokens per sequence at most" in out
    listed = out.split("tokens a KV pool holds on these stages (--kv): ")[1].split("\n")[0]
    pools = dict(item.split(": ") for item in listed.split(", "))
    assert pools["tq3"] == "none"  # head size 32
    planned = re.search(r"\((\d+) tokens q8 at ", out)
    assert set(pools) == set(FORMATS) and planned and pools["q8"] == f"{int(planned.group(1)):,}"
    assert main(["info", str(tiny_model_path), "--gpu-mem", "2G", "--kv", "tq3"]) == 0
    assert "gpu plan      the GPU's tq3 codes need a head size" in capsys.readouterr().out  # head size 32


def test_tokenize_prints_ids(tiny_model_path, capsys):
    assert main(["tokenize", "-m", str(tiny_model_path), "Hello<|im_end|>"]) == 0
    ids = [int(i) for i in capsys.readouterr().out.split()]
    assert len(ids) == 3  # "He" and "llo" (merged), then the special token whole
    assert ids[-1] == 256 + 3 + 2  # <|im_end|> in the tiny vocabulary


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["info", "missing.gguf"], "no such file"),
        (["run", "-m", "missing.gguf", "-p", "x"], "no such file"),
        (["tokenize", "-m", "missing.gguf", "x"], "no such file"),
        (["run", "--backend", "cpu", "--gpus", "0,x", "-p", "x"], "--gpus takes numbers separated by commas"),
        (["run", "--backend", "cpu", "--split=-1,2", "-p", "x"], "--split takes numbers of 0 or more"),
        (["run", "--backend", "cpu", "--gpus", "0,0", "-p", "x"], "the cpu backend has none"),
        (["run", "--backend", "cpu", "--gpu-mem", "16G,lots", "-p", "x"], "cannot read the size 'lots'"),
        (["--gpus", "0,x"], "--gpus takes numbers separated by commas"),  # the app, before it takes the terminal
        (["chat", "--url", "http://localhost:1/v1", "--gpus", "0,0"], "with --url the server has its own"),
    ],
)
def test_user_errors_are_one_line_without_traceback(args, fragment, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cmpchat", *args], cwd=tmp_path, capture_output=True, text=True, env=os.environ.copy()
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cmpchat: error:") and fragment in lines[0]


def test_not_a_gguf_file(tmp_path, capsys):
    bogus = tmp_path / "notes.txt"
    bogus.write_text("hello")
    assert main(["info", str(bogus)]) == 1
    assert "not a GGUF file" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_model_is_built_once_and_runs(capsys):
    """The quick start: no model given, so the demo model is built into the (test) cache and used."""
    assert main(["run", "-p", "Hello", "-n", "4", "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "random" in err and "tok/s" in err
    assert main(["run", "-p", "Hello", "-n", "4", "--seed", "1"]) == 0
    assert "writing the demo model" not in capsys.readouterr().err


def test_info_prints_the_type_mix_and_why_cuda_refuses_a_file(tmp_path, capsys):
    path = tmp_path / "q4_k_m.gguf"
    build_model(path, WIDE_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=None, mix="Q4_K_M")
    assert main(["info", str(path)]) == 0
    lines = {line[:13].strip(): line[14:] for line in capsys.readouterr().out.splitlines()}
    assert lines["tensors"].startswith("53: Q4_K x")
    assert "Q6_K x" in lines["tensors"] and "Q5_0 x" in lines["tensors"] and "F32 x21" in lines["tensors"]
    assert "backends" not in lines  # both backends read it
    iq = tmp_path / "iq.gguf"
    mix = {**matrix_types(WIDE_SHAPE, "Q4_K_M"), "blk.1.ffn_down.weight": GGMLQuantizationType.IQ4_XS}
    build_model(iq, WIDE_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=None, mix=mix)
    assert main(["info", str(iq)]) == 0
    lines = {line[:13].strip(): line[14:] for line in capsys.readouterr().out.splitlines()}
    assert lines["backends"].startswith("cpu reads every tensor; cuda refuses the file: ")
    assert "'blk.1.ffn_down.weight' is IQ4_XS" in lines["backends"]
