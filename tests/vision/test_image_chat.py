"""Images through the Python API and `cmpchat run`: the projector paired or given, each image encoded once
per conversation, saved states keyed by the images, and one clear line for what cannot be read."""

from __future__ import annotations

import shutil

import pytest

import cmpchat
from cmpchat.chat.messages import ImagePart, Message, TextPart
from cmpchat.cli import main
from cmpchat.engine.events import ContentDelta, Finished
from cmpchat.engine.reply import GenerationOptions
from cmpchat.errors import CmpchatError
from cmpchat.sampling import SamplingParams
from tests.vision.vision_fixtures import FIXTURES, MMPROJ_F32, ORACLE, TEXT_F32, manifest

GREEDY = GenerationOptions(sampling=SamplingParams(temperature=0.0), max_tokens=4)
IMAGE = FIXTURES / manifest()["cases"]["grow_rgba"]["image"]
OTHER_IMAGE = FIXTURES / manifest()["cases"]["round_rgb"]["image"]


@pytest.fixture(scope="module")
def model():
    from cmpchat.vision.preprocess import PixelBudget

    return cmpchat.open_model(TEXT_F32, backend="cpu", mmproj=MMPROJ_F32, image_budget=PixelBudget(8192, 65536))


def reply(model, messages) -> tuple[str, Finished]:
    text, finished = "", None
    for event in model.chat(messages, GREEDY):
        if isinstance(event, ContentDelta):
            text += event.text
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    return text, finished


def test_a_conversation_encodes_its_image_once_and_resumes_from_its_state(model):
    assert model.supports_images
    first = [Message("user", [ImagePart(str(IMAGE)), TextPart("What is it?")])]
    encoded = model.image_encoder.encoded
    answer, _ = reply(model, first)
    second = [*first, Message("assistant", answer), Message("user", "And now?")]
    _, finished = reply(model, second)
    assert model.image_encoder.encoded == encoded + 1  # the second turn found the image encoded
    request = model.chat_request(second, GREEDY)
    assert request.images is not None and len(request.images.starts) == 1
    # Its prompt resumed from the state the first turn left: only the new turn was read.
    assert finished.timings.prompt_tokens < len(request.prompt) - 12


def test_prompts_that_differ_only_in_their_image_do_not_share_saved_states(model):
    model.engine.prefix_cache.clear()
    ask = [TextPart("What is it?")]
    reply(model, [Message("user", [ImagePart(str(IMAGE)), *ask])])
    _, finished = reply(model, [Message("user", [ImagePart("other", data=OTHER_IMAGE.read_bytes()), *ask])])
    image_pad = model.tokenizer.token_to_id("<|image_pad|>")
    request = model.chat_request([Message("user", [ImagePart("other", data=OTHER_IMAGE.read_bytes()), *ask])])
    first_pad = list(request.prompt).index(image_pad)
    assert finished.timings.prompt_tokens > len(request.prompt) - first_pad - 1  # read from the image on


def test_image_pads_expand_and_cache_points_move_with_them(model):
    messages = [
        Message("system", "Be brief."),
        Message("user", [ImagePart(str(IMAGE)), ImagePart(str(IMAGE)), TextPart("Same?")]),
    ]
    request = model.chat_request(messages)
    image_pad = model.tokenizer.token_to_id("<|image_pad|>")
    assert list(request.prompt).count(image_pad) == 2 * 12
    text_only = model.chat_request([messages[0], Message("user", "Same?")])
    system_end = min(text_only.cache_points)
    assert system_end in request.cache_points  # before the images: unmoved
    assert max(request.cache_points) > max(text_only.cache_points) + 2 * 11 - 1  # after them: moved past both


def test_generate_takes_images_for_its_pad_tokens(model):
    events = list(model.generate("<|vision_start|><|image_pad|><|vision_end|>Hi", GREEDY, images=[IMAGE]))
    assert isinstance(events[-1], Finished)
    with pytest.raises(CmpchatError, match="image placeholders for 2 images"):
        list(model.generate("<|image_pad|>", GREEDY, images=[IMAGE, IMAGE]))


def test_a_corrupt_image_is_one_clear_line(model, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a picture")
    with pytest.raises(CmpchatError, match="broken.png could not be read as an image") as caught:
        model.chat_request([Message("user", [ImagePart(str(broken)), TextPart("?")])])
    assert "\n" not in str(caught.value)
    with pytest.raises(CmpchatError, match="missing.png could not be read"):
        model.chat_request([Message("user", [ImagePart(str(tmp_path / "missing.png"))])])


def test_a_projector_of_another_width_is_one_clear_line():
    with pytest.raises(CmpchatError, match="projects images to width 32, but the model's hidden size is 64"):
        cmpchat.open_model(ORACLE / "tiny_untied.f32.gguf", backend="cpu", mmproj=MMPROJ_F32)


def test_a_model_without_a_projector_or_a_backend_without_images_refuses_them(model):
    bare = cmpchat.open_model(ORACLE / "tiny_tied.f32.gguf", backend="cpu")
    assert not bare.supports_images
    with pytest.raises(CmpchatError, match="opened without a vision projector; give its mmproj file"):
        list(bare.generate("<|image_pad|>", GREEDY, images=[IMAGE]))
    no_encoder = cmpchat.api.Model(model.model_file, model.backend, projector_path=MMPROJ_F32)
    with pytest.raises(CmpchatError, match="backend does not read images"):
        no_encoder.chat_request([Message("user", [ImagePart(str(IMAGE))])])


def test_the_projector_beside_the_model_is_paired(tmp_path):
    shutil.copy(TEXT_F32, tmp_path / "tiny-vision.gguf")
    shutil.copy(MMPROJ_F32, tmp_path / "mmproj-tiny-vision.gguf")
    paired = cmpchat.open_model(tmp_path / "tiny-vision.gguf", backend="cpu")
    assert paired.supports_images and paired.projector_path == tmp_path / "mmproj-tiny-vision.gguf"


def test_run_answers_about_images(capsys):
    args = ["run", "-m", str(TEXT_F32), "--backend", "cpu", "--mmproj", str(MMPROJ_F32), "-n", "3", "--temp", "0"]
    assert main([*args, "--image", str(IMAGE), "--image", str(OTHER_IMAGE), "-p", "Same?"]) == 0
    assert "prompt:" in capsys.readouterr().err
    assert main([*args, "--image", str(FIXTURES / "README.md"), "-p", "?"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("cmpchat: error: README.md could not be read as an image")
