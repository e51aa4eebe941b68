"""The whole model with an image (tiny_tied's text model and the tiny vision tower, one checkpoint converted by
llama.cpp) against transformers' Qwen3_5ForConditionalGeneration logits for a ChatML prompt with one image."""

from __future__ import annotations

import numpy as np

from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.model.gguf_file import ModelFile
from cmpchat.vision.prompt_images import PromptImages
from tests.vision.test_image_prefill import IMAGE_PAD, encoded
from tests.vision.vision_fixtures import TEXT_F32, arrays, manifest

# As the text oracle's: other summation orders stay far below it, the plausible bugs far above.
TOLERANCE = 1e-3


def placed_prompt() -> tuple[list[int], PromptImages]:
    oracle = arrays("whole_model")
    ids = oracle["ids"].tolist()
    first = ids.index(IMAGE_PAD)
    template = [token for i, token in enumerate(ids) if token != IMAGE_PAD or i == first]  # one pad per image
    tokens, placed = PromptImages.place(template, [encoded(manifest()["whole_model"]["image"])], IMAGE_PAD, 2)
    assert tokens == ids
    np.testing.assert_array_equal(placed.positions, oracle["position_ids"].T)
    return tokens, placed


def test_logits_with_an_image_are_transformers_token_by_token():
    tokens, placed = placed_prompt()
    backend = ReferenceBackend(ModelFile(TEXT_F32))
    sequence = backend.new_sequence()
    expected = arrays("whole_model")["logits"]
    for t in range(len(tokens)):  # one step a token: every row checked, images read a row at a time
        positions, rows = placed.step_inputs(t, t + 1)
        logits = backend.prefill_with_images(sequence, tokens[t : t + 1], positions=positions, images=rows).values
        np.testing.assert_allclose(logits[0], expected[t], rtol=0, atol=TOLERANCE, err_msg=f"token {t}")


def test_a_prompt_with_an_image_then_decoding_gives_transformers_logits():
    tokens, placed = placed_prompt()
    prompt = int(arrays("whole_model")["prompt_tokens"])
    backend = ReferenceBackend(ModelFile(TEXT_F32))
    sequence = backend.new_sequence()
    expected = arrays("whole_model")["logits"]
    positions, rows = placed.step_inputs(0, prompt)
    logits = backend.prefill_with_images(sequence, tokens[:prompt], positions=positions, images=rows).values
    np.testing.assert_allclose(logits[0], expected[prompt - 1], rtol=0, atol=TOLERANCE)
    for t in range(prompt, len(tokens)):
        logits = backend.decode([sequence], [tokens[t]]).values
        np.testing.assert_allclose(logits[0], expected[t], rtol=0, atol=TOLERANCE, err_msg=f"token {t}")
