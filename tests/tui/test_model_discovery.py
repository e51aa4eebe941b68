"""Finding GGUF models in the usual folders, with projectors paired and split files listed once."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest

from cmpchat.model.discovery import SearchRoot, default_roots, find_models
from cmpchat.model.gguf_parse import read_scalar_metadata


def write_gguf(path: Path, architecture: str, name: str | None = None, *, general_type: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), architecture)
    if name:
        writer.add_name(name)
    if general_type:
        writer.add_type(general_type)
    writer.add_token_list(["a", "b"])  # an array: the header reader stops here
    writer.add_string("after.the.array", "not read")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_header_reader_gets_the_leading_scalars(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "qwen35", "Qwen3.5 9B")
    header = read_scalar_metadata(path)
    assert header is not None
    assert header["general.architecture"] == "qwen35" and header["general.name"] == "Qwen3.5 9B"
    assert "after.the.array" not in header
    (tmp_path / "bad.gguf").write_bytes(b"nope")
    assert read_scalar_metadata(tmp_path / "bad.gguf") is None


def test_models_are_found_paired_with_projectors_and_sorted(tmp_path):
    lm = tmp_path / "lmstudio" / "unsloth" / "Qwen3.5-9B-GGUF"
    write_gguf(lm / "Qwen3.5-9B-Q8_0.gguf", "qwen35", "Qwen3.5 9B")
    write_gguf(lm / "mmproj-Qwen3.5-9B-F16.gguf", "clip", general_type="mmproj")
    models = tmp_path / "models"
    write_gguf(models / "llama-3-8b.gguf", "llama", "Llama 3 8B")
    write_gguf(models / "big-00001-of-00002.gguf", "qwen35", "Big")
    write_gguf(models / "big-00002-of-00002.gguf", "qwen35", "Big")
    (models / "notes.txt").write_text("not a model")
    (models / "broken.gguf").write_bytes(b"GG")
    roots = [
        SearchRoot("LM Studio", tmp_path / "lmstudio"),
        SearchRoot("~/models", models),
        SearchRoot("x", tmp_path / "missing"),
    ]
    found = find_models(roots)
    assert [m.name for m in found] == ["Big", "Qwen3.5 9B", "Llama 3 8B"]  # runnable first, then by name
    qwen = found[1]
    assert qwen.supported and qwen.source == "LM Studio" and qwen.projector == lm / "mmproj-Qwen3.5-9B-F16.gguf"
    assert not found[2].supported and found[2].projector is None
    assert found[0].path.name == "big-00001-of-00002.gguf"


def test_hugging_face_cache_symlinks_are_followed_and_listed_once(tmp_path):
    repo = tmp_path / "hub" / "models--Qwen--Qwen3.5-0.8B-GGUF"
    blob = write_gguf(repo / "blobs" / "0123abcd", "qwen35", "Qwen3.5 0.8B")
    for revision in ("main1", "main2"):
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        os.symlink(blob, snapshot / "Qwen3.5-0.8B-Q8_0.gguf")
    found = find_models([SearchRoot("Hugging Face cache", tmp_path / "hub")])
    assert len(found) == 1 and found[0].path.name == "Qwen3.5-0.8B-Q8_0.gguf" and found[0].size == blob.stat().st_size


def test_default_roots_follow_the_tools_own_environment_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    roots = default_roots(["~/extra"])
    paths = {root.label: root.path for root in roots}
    assert paths["llama.cpp cache"] == tmp_path / "llama"
    assert paths["Hugging Face cache"] == tmp_path / "hf"
    assert paths["~/models"] == Path.home() / "models"
    assert roots[-1] == SearchRoot("settings", Path.home() / "extra")
    assert any(root.path == Path.home() / ".lmstudio" / "models" for root in roots)


@pytest.mark.parametrize("variable", ["HF_HOME", "XDG_CACHE_HOME"])
def test_hugging_face_home_decides_the_hub_folder(monkeypatch, tmp_path, variable):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv(variable, str(tmp_path))
    hub = {root.label: root.path for root in default_roots()}["Hugging Face cache"]
    expected = tmp_path / "hub" if variable == "HF_HOME" else tmp_path / "huggingface" / "hub"
    assert hub == expected
