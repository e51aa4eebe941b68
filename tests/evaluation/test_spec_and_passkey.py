"""Engine specs (`key=value,...`) and the pass-key task's prompt, answer check and counting."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import pytest

from cmpchat import Finished, Model, Timings
from cmpchat.engine.reply import GenerationOptions
from cmpchat.errors import CmpchatError
from cmpchat.evaluation import passkey, spec
from cmpchat.evaluation.needle import lengths_up_to, needle_grid
from cmpchat.evaluation.spec import EngineKey, EngineSpec


def test_a_spec_gives_open_model_arguments_and_the_model_file():
    s = EngineSpec.parse("backend=cpu, mirror_gpu=1,context=4096,gpu_mem=16G,model=other.gguf")
    assert s.open_arguments() == {"backend": "cpu", "mirror_gpu": True, "context": 4096, "gpu_mem": 16 * 2**30}
    assert str(s.model_path("default.gguf")) == "other.gguf"
    assert EngineSpec.parse("").open_arguments() == {} and str(EngineSpec.parse("").model_path("m.gguf")) == "m.gguf"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("backend", "is not key=value"),
        ("sparse=1", "unknown key 'sparse'"),
        ("kv=tq2", "bad value 'tq2' for kv: expected one of f16, q8, tq3, q8k-tq3v, naive3, q4_0"),
        ("backend=tpu", "expected one of auto, cpu, cuda"),
        ("context=0", "bad value '0' for context"),
        ("backend=cpu,backend=cuda", "given twice"),
    ],
)
def test_bad_specs_say_what_is_wrong(text, fragment):
    with pytest.raises(CmpchatError, match=fragment):
        EngineSpec.parse(text)


def test_new_keys_plug_in(monkeypatch):
    monkeypatch.setattr(spec, "KEYS", dict(spec.KEYS))
    spec.register_key(EngineKey("sparse", str, "sparse prefill pattern", "sparse_prefill"))
    assert EngineSpec.parse("sparse=vertical").open_arguments() == {"sparse_prefill": "vertical"}
    with pytest.raises(ValueError, match="already registered"):
        spec.register_key(EngineKey("sparse", str, "again"))


@pytest.mark.parametrize("name", ["f16", "q8", "tq3", "q8k-tq3v", "naive3", "q4_0"])
def test_the_kv_key_takes_every_format_and_baseline(name):
    assert EngineSpec.parse(f"backend=cpu,kv={name}").open_arguments() == {"backend": "cpu", "kv": name}


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character, digits as themselves."""
    return [ord(c) for c in text]


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_a_prompt_has_the_exact_length_and_the_key_at_its_depth(depth):
    prompt = passkey.build_prompt(encode, 2000, depth, "48213")
    assert len(prompt) == 2000
    text = "".join(map(chr, prompt))
    needle = passkey.NEEDLE.format(key="48213")
    assert text.count(needle) == 1 and text.startswith(passkey.INTRO) and text.endswith(passkey.QUESTION)
    filler = 2000 - passkey.fixed_length(encode)
    assert text.index(needle) - len(passkey.INTRO) == round(depth * filler)


def test_a_prompt_too_short_for_the_task_is_refused():
    with pytest.raises(ValueError, match="at least"):
        passkey.build_prompt(encode, passkey.fixed_length(encode) - 1, 0.5, "48213")


@pytest.mark.parametrize(
    ("reply", "passed"), [(" 48213.", True), ("48213", True), (" 4821", False), (" 482130", False), (" The key", False)]
)
def test_a_trial_passes_on_the_key_alone(reply, passed):
    assert passkey.recalled(reply, "48213") is passed


class Recaller:
    """A model that answers with the key when the prompt's needle lies in its first half, else a wrong one."""

    def tokenize(self, text: str, *, parse_special: bool = False) -> list[int]:
        return encode(text)

    def generate(self, prompt: Sequence[int], options: GenerationOptions) -> Iterator[Finished]:
        text = "".join(map(chr, prompt))
        at = text.index("The pass key is ")
        key = text[at + 16 : at + 16 + passkey.KEY_DIGITS]
        reply = f" {key}." if at < len(text) / 2 else " 11111."
        yield Finished("length", reply, "", (), Timings(len(prompt), 1.0, 3, 2, 1.0, 0.1))


def test_the_grid_counts_each_cell_and_finds_the_longest_reliable_length():
    recaller = cast(Model, Recaller())  # needle_grid uses only `tokenize` and `generate`
    grid = needle_grid(recaller, [500, 1000], [0.1, 0.3, 0.8], trials=4)
    assert grid.accuracy == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    assert grid.longest_at(0.9) is None
    grid = needle_grid(recaller, [500, 1000], [0.2], trials=3)
    assert grid.longest_at(0.9) == 1000 and grid.trials == 3


def test_lengths_double_from_1k_to_the_limit():
    assert lengths_up_to(8192) == [1024, 2048, 4096, 8192]
    assert lengths_up_to(6000) == [1024, 2048, 4096, 6000]
    assert lengths_up_to(700) == [700]
