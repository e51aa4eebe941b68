"""The reference backend's KV cache in each format (cmpchat/kv_formats.py): paged storage, attention in the
rotated domain against decode-then-attend (the specification the GPU kernels will be held to), the trained
model's logits per format against f16, and the formats through `open_model` and the command line."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest

import cmpchat
from cmpchat.backends.reference.attention import PagedKv, attend, attend_rotated
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.cli import main
from cmpchat.errors import CmpchatError
from cmpchat.evaluation.quality import log_softmax
from cmpchat.kv_formats import BASELINES, F16, F32, FORMATS, TQ3, Float, KvFormat
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile

ALL = {**FORMATS, **BASELINES}
TRAINED = Path(__file__).parents[1] / "fixtures" / "trained"
MODEL = TRAINED / "trained.q8_0.gguf"
PASSKEY = json.loads((TRAINED / "manifest.json").read_text())["prompts"]["passkey"]
"""600 tokens: a pass key at 30% depth in filler text, then the question (the model answers it)."""


@cache
def model_file() -> ModelFile:
    return ModelFile(MODEL)


def small_config(heads: int = 4, kv_heads: int = 2, head_dim: int = 256) -> ModelConfig:
    config = ModelConfig.from_model_file(model_file())
    return dataclasses.replace(config, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


# -- the paged store --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL))
def test_pages_hold_what_the_codec_decodes_across_pages_and_copies(name):
    fmt = ALL[name]
    config = small_config()
    kv = PagedKv(config, 16, fmt)
    rng = np.random.default_rng(1)
    keys, values = (rng.standard_normal((40, 2, 256)).astype(np.float32) for _ in "kv")
    pages = [5, 2, 9]
    kv.write(3, pages, 0, keys[:25], values[:25])  # a prefill across a page boundary, then tokens one by one
    for t in range(25, 40):
        kv.write(3, pages, t, keys[t : t + 1], values[t : t + 1])
    got_keys, got_values = kv.read(3, pages, 40)
    assert np.array_equal(got_keys, fmt.key.decode(fmt.key.encode(keys)))
    assert np.array_equal(got_values, fmt.value.decode(fmt.value.encode(values)))
    kv.copy_page([3], 9, 4, 8)  # copy on write of a partial last page
    copied_keys, _ = kv.read(3, [5, 2, 4], 40)
    assert np.array_equal(copied_keys, got_keys)
    stored_keys, _ = kv.stored(3, pages, 40)
    assert sum(a.nbytes for a in stored_keys) == 40 * 2 * fmt.key.bytes_per_vector(256)


def test_a_format_the_head_size_cannot_take_is_refused():
    with pytest.raises(CmpchatError, match="tq3 KV format needs a head size that is a multiple of 128, not 192"):
        PagedKv(small_config(head_dim=192), 16, FORMATS["tq3"])


# -- attention in the rotated domain ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize(("past", "steps"), [(0, 37), (52, 1), (29, 6)])
def test_attention_in_the_rotated_domain_equals_decode_then_attend(name, past, steps):
    """The GPU's way (rotate q once, score against the codebook values times the scale, sum V rotated, one
    inverse transform per head output) against decoding the cache first: equal to fp32 rounding."""
    fmt = ALL[name]
    rng = np.random.default_rng(past + steps)
    kv = PagedKv(small_config(), 16, fmt)
    keys, values = (rng.standard_normal((past + steps, 2, 256)).astype(np.float32) * 3 for _ in "kv")
    query = rng.standard_normal((steps, 4, 256)).astype(np.float32) * 3
    kv.write(0, [0, 1, 2, 3], 0, keys, values)
    decoded = attend(query, *kv.read(0, [0, 1, 2, 3], past + steps), past)
    rotated = attend_rotated(query, *kv.read_rotated(0, [0, 1, 2, 3], past + steps), past, fmt)
    assert rotated.shape == decoded.shape == (steps, 4, 256)
    assert np.abs(rotated - decoded).max() <= 1e-5 * np.abs(decoded).max()
    if fmt.key.rotated:  # the rotated path really never decodes the keys: it reads other numbers
        rotated_keys, _ = kv.read_rotated(0, [0, 1, 2, 3], past + steps)
        assert not np.allclose(rotated_keys, kv.read(0, [0, 1, 2, 3], past + steps)[0], atol=0.1)


# -- the trained model per format -------------------------------------------------------------------

KL_BOUND = {"f16": 1e-6, "q8": 1e-4, "tq3": 0.025, "q8k-tq3v": 0.006, "naive3": 0.04, "q4_0": 0.01}
"""Mean KL from f16 over the pass-key prompt's positions, at most: about three times each format's mean over
13,797 scored tokens of text (docs/performance.md, "KV formats: quality on the trained model": 1.1e-5,
7.7e-3, 1.8e-3, 1.3e-2, 3.0e-3; fp16 against the fp32 cache ~1e-8 here). A codec that is wrong rather than
lossy (a transform not undone, codes read in another order) gives keys and values that are noise: KL of order
0.1-1 (the last test shows one)."""


@cache
def passkey_log_probs(fmt: KvFormat, rotated: bool = False) -> np.ndarray:
    backend = ReferenceBackend(model_file(), kv=fmt, rotated_attention=rotated, context=1024)
    return log_softmax(backend.score(backend.new_sequence(), PASSKEY["ids"]))


def mean_kl(base: np.ndarray, test: np.ndarray) -> float:
    return float((np.exp(base) * (base - test)).sum(axis=-1).mean())


@pytest.mark.parametrize("name", sorted(KL_BOUND))
def test_the_trained_models_logits_per_format_stay_close_to_f16(name):
    base = passkey_log_probs(F16)
    got = passkey_log_probs(ALL[name])
    assert mean_kl(base, got) <= KL_BOUND[name]
    agree = np.mean(base.argmax(-1) == got.argmax(-1))
    assert agree >= {"f16": 1.0, "q8": 0.99}.get(name, 0.9)


def test_fp16_pages_are_the_fp32_cache_rounded():
    assert mean_kl(passkey_log_probs(F32), passkey_log_probs(F16)) < 1e-6


@pytest.mark.parametrize("name", ["tq3", "q8k-tq3v"])
def test_the_whole_model_attends_the_same_in_the_rotated_domain(name):
    decoded, rotated = passkey_log_probs(ALL[name]), passkey_log_probs(ALL[name], rotated=True)
    # fp32 rounding, except where it moves a later layer's key or value across a q8 or tq3 rounding
    # boundary: one code a step apart (measured 5e-5 of the largest log-probability with q8 keys)
    assert np.abs(rotated - decoded).max() <= 1e-3 * np.abs(decoded).max()
    assert np.mean(rotated.argmax(-1) == decoded.argmax(-1)) >= 0.99


class Unrotated(TQ3):
    """A broken tq3: values decoded without the inverse transform."""

    def decode(self, stored):
        return self.decode_rotated(stored)


def test_the_bound_tells_a_wrong_codec_from_a_lossy_one():
    broken = KvFormat("broken", Float(np.float16), Unrotated(), "")
    assert mean_kl(passkey_log_probs(F16), passkey_log_probs(broken)) > 10 * KL_BOUND["tq3"]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_generates(name):
    backend = ReferenceBackend(model_file(), kv=name, context=1024, page_tokens=64)
    sequence = backend.new_sequence()
    ids = PASSKEY["ids"][:200]
    logits = backend.prefill(sequence, ids).values
    out = []
    for _ in range(6):  # decode steps append to the cache token by token, across a page boundary
        token = int(logits[-1].argmax())
        out.append(token)
        logits = backend.decode([sequence], [token]).values
    assert backend.length(sequence) == 206 and len(out) == 6
    assert backend.describe() == [
        f"KV cache: {name} ({ALL[name].bits_per_value:g} bits a value, "
        f"{ALL[name].bytes_per_token(backend.config):,} bytes a token)"
    ]


# -- open_model and the command line ----------------------------------------------------------------


def test_open_model_takes_a_format_and_answers_the_pass_key():
    model = cmpchat.open_model(MODEL, backend="cpu", kv="q8k-tq3v", context=1024)
    assert isinstance(model.backend, ReferenceBackend) and model.backend.kv.format is FORMATS["q8k-tq3v"]
    options = cmpchat.GenerationOptions(max_tokens=6, sampling=cmpchat.SamplingParams(temperature=0.0))
    finished = [e for e in model.generate(PASSKEY["ids"], options) if isinstance(e, cmpchat.Finished)]
    assert PASSKEY["key"] in finished[0].content


def test_the_cuda_backend_refuses_a_baseline_before_touching_a_device():
    with pytest.raises(CmpchatError) as raised:
        cmpchat.open_model(MODEL, backend="cuda", kv="naive3")
    message = str(raised.value)
    assert "\n" not in message and "naive3 KV cache runs on the CPU reference backend only" in message
    assert "the cuda backend takes f16, q8, tq3, q8k-tq3v" in message


class StopLoading(CmpchatError):
    """What the recording CudaBackend raises once it has the options it was given."""


@pytest.fixture
def cuda_options(monkeypatch):
    """The options `open_model` gives CudaBackend, which then stops (no simulated GPU step runs)."""
    from cmpchat.backends.gpu.model import CudaBackend

    given: dict = {}

    def record(self, model_file, config=None, **options):
        given.update(options)
        raise StopLoading("stopped after the options")

    monkeypatch.setattr(CudaBackend, "__init__", record)
    return given


@pytest.mark.parametrize("name", ["q8", "tq3", "q8k-tq3v"])
def test_the_cuda_backend_takes_the_gpu_formats(cuda_options, name):
    with pytest.raises(StopLoading):
        cmpchat.open_model(MODEL, backend="cuda", kv=name)
    assert cuda_options["kv"] == name


def test_unknown_formats_are_one_line():
    with pytest.raises(CmpchatError, match="unknown KV format 'tq4'; choose one of: f16, q8, tq3, q8k-tq3v, naive3"):
        cmpchat.open_model(MODEL, backend="cpu", kv="tq4")


def test_run_takes_kv(capsys, cuda_options):
    assert main(["run", "-m", str(MODEL), "--backend", "cuda", "--kv", "tq3", "-p", "hi"]) == 1
    assert cuda_options["kv"] == "tq3" and "stopped after the options" in capsys.readouterr().err
    assert main(["run", "-m", str(MODEL), "--backend", "cpu", "--kv", "q8", "-p", "Say", "-n", "3", "--temp", "0"]) == 0
    assert "KV cache: q8 (8.5 bits a value, 1,088 bytes a token)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--kv", "naive3", "-p", "hi"])  # baselines are for measurements, not for running
