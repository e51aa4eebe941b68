"""The trained model on a real GPU: the CUDA engine against the reference in GPU-mirroring mode, and the
pass-key grid up to NEEDLE_LIMIT.

Tolerance. Both sides quantise activations to int8 per 32 values and keep K/V in fp16. Given the same int8
activations (the engine's, recorded launch by launch on the H200 and fed to the reference in place of its own)
they agree to <= 2.3e-7 of max |logit| at every position of every prompt. Left to round for themselves, their
fp32 sums differ in order, so a value within ~1e-6 of a rounding tie rounds one way on one side and the other
way on the other (1 to 86 values a prompt, each by one step), and on this model a single such value grows,
through the roundings it changes downstream, to the int8 rounding noise itself. On `prose` with the model
committed before this one (sha256 d885651a...) the reference rounds 6.499987 to 6 where the engine rounds to 7
(the input of layer 4, position 0): through fp32 arithmetic that moves the logits by 9.1e-5 of max |logit|,
through the 13, 5, 19, ... 97 int8 values it changes in the following matmul inputs by 1.05e-2, and the
engine's logits equal the reference's with that value rounded up to 1.6e-7. The reference against itself with
only a summation order changed (its matmul blocks added in reverse) moves by up to 3e-3 to 1e-2 of max |logit|
on most prompts, as far as its int8 rounding moves it from fp32 (median 3e-3 to 9e-3, max 9e-3 to 1.6e-2):
once one value rounds differently, the two are two draws of the rounding noise.

So each prompt is held to twice that noise, measured here (the reference in mirror mode against exact fp32,
per position |dlogit| / max |logit|, median and max; never below 1e-3, the bound where nothing rounds
differently), and the top-1 tokens must agree wherever the reference's first two choices differ by > 0.1.
On the H200, with this model and the one before, every median and max stayed below half its bound (`prose`:
median 6.0e-3, max 1.28e-2 against 1.6e-2 and 2.8e-2), and no top-1 token differed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import cmpchat
from cmpchat.cli import main

pytestmark = pytest.mark.gpu

TRAINED = Path(__file__).parent.parent / "fixtures" / "trained"
MODEL = TRAINED / "trained.q8_0.gguf"
CLEAR_MARGIN = 0.1
SUMMATION_TOLERANCE = 1e-3
"""Per position |dlogit| / max |logit| of two mirroring implementations where no int8 value rounds differently."""
NEEDLE_LIMIT = 65536


def per_position_error(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return np.abs(got - expected).max(axis=1) / np.abs(expected).max(axis=1)


def assert_agrees_with_the_mirror(got: np.ndarray, expected: np.ndarray, exact: np.ndarray) -> str:
    """`got` (an engine rounding as the GPU does) against `expected` (the reference in mirror mode) within twice
    the reference's own int8 rounding noise (`exact`: the reference in fp32); the numbers, for the log."""
    error, noise = per_position_error(got, expected), per_position_error(exact, expected)
    median_bound = max(SUMMATION_TOLERANCE, 2 * float(np.median(noise)))
    max_bound = max(SUMMATION_TOLERANCE, 2 * float(noise.max()))
    report = (
        f"{len(got)} tokens: |dlogit| / max |logit|: median {np.median(error):.2e} (bound {median_bound:.2e}), "
        f"max {error.max():.2e} (bound {max_bound:.2e})"
    )
    assert np.median(error) <= median_bound and error.max() <= max_bound, report
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > CLEAR_MARGIN
    assert np.array_equal(got[clear].argmax(axis=1), expected[clear].argmax(axis=1)), report
    return report


def test_gpu_engine_equals_the_reference_in_mirror_mode():
    with np.load(TRAINED / "trained.npz") as data:
        prompts = [data[k].tolist() for k in data.files if k.startswith("ids_")]
    gpu = cmpchat.open_model(MODEL, backend="cuda", context=4096)
    reference = cmpchat.open_model(MODEL, backend="cpu", mirror_gpu=True)
    exact = cmpchat.open_model(MODEL, backend="cpu")
    for tokens in prompts:
        print(assert_agrees_with_the_mirror(gpu.logits(tokens), reference.logits(tokens), exact.logits(tokens)))


@pytest.mark.slow
def test_needle_grid_on_the_gpu_up_to_the_limit(capsys):
    """The whole grid runs on the GPU; the issue's pass mark is >= 95% at every depth at 8K tokens."""
    assert main(["eval", str(MODEL), "--needle", "--needle-max", str(NEEDLE_LIMIT), "--base", "backend=cuda",
                 "--json"]) == 0  # fmt: skip
    grid = json.loads(capsys.readouterr().out)["needle"]["backend=cuda"]
    print(json.dumps(grid))
    assert grid["trials"] >= 20 and grid["lengths"][-1] == NEEDLE_LIMIT and len(grid["depths"]) == 9
    print(f"longest context with >= 90% at every depth: {grid['longest_at_90']}")
    assert min(grid["accuracy"][grid["lengths"].index(8192)]) >= 0.95  # the model card's 8K row
