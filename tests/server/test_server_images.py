"""Images through `cmpchat serve`: the tiny vision model and its projector on the reference backend, sent data URIs
(and, when the server is told to fetch them, URLs) by the official openai and anthropic clients. The prompt the
engine reads holds each image's run of pad tokens and the image's rows: the server's reply and log-probabilities
are the Python API's for the same messages. What cannot be read is a 400 of one line that names the part."""

from __future__ import annotations

import base64
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmpchat.api import Model, open_model
from cmpchat.chat.messages import ImagePart, Message, TextPart
from cmpchat.engine.reply import GenerationOptions
from cmpchat.sampling import SamplingParams, TokenLogprobs
from cmpchat.server import images
from cmpchat.server.settings import ServerSettings
from cmpchat.vision.preprocess import PixelBudget
from tests.server.conftest import client_for
from tests.server.live import LiveServer, live_server
from tests.vision.vision_fixtures import FIXTURES, MMPROJ_F32, TEXT_F32, manifest

IMAGE = (FIXTURES / manifest()["cases"]["grow_rgba"]["image"]).read_bytes()
IMAGE_TOKENS = manifest()["cases"]["grow_rgba"]["image_tokens"]
OTHER_IMAGE = (FIXTURES / manifest()["cases"]["round_rgb"]["image"]).read_bytes()
QUESTION = "What is it?"
STEPS = 3


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def open_vision_model(sequences: int = 2) -> Model:
    return open_model(
        TEXT_F32, backend="cpu", mmproj=MMPROJ_F32, image_budget=PixelBudget(8192, 65536), sequences=sequences
    )


@pytest.fixture(scope="module")
def vision_server() -> Iterator[LiveServer]:
    settings = ServerSettings(port=0, slots=2, model_name="vision")
    with live_server(settings, open_vision_model) as server:
        yield server


@pytest.fixture(scope="module")
def fetching_server() -> Iterator[LiveServer]:
    settings = ServerSettings(port=0, slots=2, model_name="vision", allow_remote_images=True)
    with live_server(settings, open_vision_model) as server:
        yield server


@pytest.fixture(scope="module")
def client(vision_server: LiveServer) -> openai.OpenAI:
    return client_for(vision_server)


@pytest.fixture(scope="module")
def reference() -> Model:
    """The Python API on the same files, for the prompt and the reply the server should make."""
    return open_vision_model()


def with_image(data: bytes = IMAGE) -> list[Message]:
    return [Message("user", [ImagePart("image", data=data), TextPart(QUESTION)])]


def chat_image(url: str) -> list[Any]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}],
        }
    ]


def api_reply(model: Model, messages: list[Message]) -> tuple[str, list[TokenLogprobs]]:
    options = GenerationOptions(sampling=SamplingParams(temperature=0.0), max_tokens=STEPS, logprobs=0)
    text, logprobs = "", []
    for event in model.chat(messages, options):
        if isinstance(event, TokenLogprobs):
            logprobs.append(event)
        elif hasattr(event, "text"):
            text += event.text
    return text, logprobs


def prompt_tokens(model: Model, messages: list[Message]) -> int:
    return len(model.chat_request(messages).prompt)


def test_an_image_in_a_data_uri_reaches_the_model(client: openai.OpenAI, reference: Model) -> None:
    reply = client.chat.completions.create(
        model="vision", messages=chat_image(data_uri(IMAGE)), max_tokens=STEPS, temperature=0, logprobs=True
    )
    assert reply.usage is not None and reply.choices[0].logprobs is not None
    # The prompt held the image's run of pad tokens: the API's count for the same messages.
    request = reference.chat_request(with_image())
    assert list(request.prompt).count(reference.tokenizer.token_to_id("<|image_pad|>") or -1) == IMAGE_TOKENS
    assert reply.usage.prompt_tokens == len(request.prompt)
    assert reply.usage.prompt_tokens == prompt_tokens(reference, [Message("user", QUESTION)]) + IMAGE_TOKENS + 2
    # ... and the image's rows: the reply and its log-probabilities are the API's, and another image's differ.
    text, expected = api_reply(reference, with_image())
    entries = reply.choices[0].logprobs.content or []
    assert reply.choices[0].message.content == text and len(entries) == len(expected)
    np.testing.assert_allclose([e.logprob for e in entries], [item.logprob for item in expected], atol=1e-4)
    _, other = api_reply(reference, with_image(OTHER_IMAGE))
    assert abs(other[0].logprob - expected[0].logprob) > 1e-3 or other[0].token != expected[0].token


def test_a_streamed_reply_about_an_image(client: openai.OpenAI, reference: Model) -> None:
    chunks = list(
        client.chat.completions.create(
            model="vision",
            messages=chat_image(data_uri(IMAGE)),
            max_tokens=STEPS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == api_reply(reference, with_image())[0]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == prompt_tokens(reference, with_image())


def test_the_responses_api_reads_input_images(client: openai.OpenAI, reference: Model) -> None:
    response = client.responses.create(
        model="vision",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_uri(IMAGE), "detail": "auto"},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
        max_output_tokens=STEPS,
        temperature=0,
    )
    assert response.usage is not None and response.usage.input_tokens == prompt_tokens(reference, with_image())
    assert response.output_text == api_reply(reference, with_image())[0]


def test_the_messages_api_reads_base64_images(vision_server: LiveServer, reference: Model) -> None:
    client = anthropic.Anthropic(base_url=vision_server.url, api_key="unused", max_retries=0, timeout=30)
    content: list[Any] = [
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMAGE).decode()},
        },
        {"type": "text", "text": QUESTION},
    ]
    messages: list[Any] = [{"role": "user", "content": content}]
    message = client.messages.create(model="vision", max_tokens=STEPS, messages=messages)
    expected = prompt_tokens(reference, with_image())
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == expected
    assert client.messages.count_tokens(model="vision", messages=messages).input_tokens == expected
    url: list[Any] = [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.content\.0: this server does not fetch"):
        client.messages.create(model="vision", max_tokens=STEPS, messages=[{"role": "user", "content": url}])


def test_props_say_the_server_reads_images(vision_server: LiveServer) -> None:
    assert httpx.get(vision_server.url + "/props").json()["modalities"] == {"vision": True, "audio": False}


def bad_request(client: openai.OpenAI, url: str, fragment: str) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="vision", messages=chat_image(url), max_tokens=1)
    error: Any = caught.value.body
    message = error["message"]
    assert message.startswith("messages.0.content.0: ") and fragment in message, message
    assert "\n" not in message and error["param"] == "messages.0.content.0"
    return message


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # cut short: bad padding
        (data_uri(b"not a picture"), "could not be read as an image"),
        (data_uri(IMAGE[: len(IMAGE) // 2]), "could not be read as an image"),
        (data_uri(b""), "the image is empty"),
        (data_uri(IMAGE, "text/plain"), "a data URI must hold a base64 image"),
        ("data:image/png," + "x" * 10, "a data URI must hold a base64 image"),
        ("http://127.0.0.1:9/a.png", "does not fetch image URLs; send the image as a data URI"),
        ("file:///etc/passwd", "must be a data URI (data:image/png;base64,...) or an http(s) URL"),
    ],
)
def test_what_cannot_be_read_is_one_line_naming_the_part(client: openai.OpenAI, url: str, fragment: str) -> None:
    bad_request(client, url, fragment)


def test_an_image_over_the_size_cap_is_refused(client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", len(IMAGE) - 1)
    bad_request(client, data_uri(IMAGE), "larger than the")
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 3 * len(IMAGE) // 4)  # refused before decoding the base64
    bad_request(client, data_uri(IMAGE), "larger than the")


@pytest.fixture(scope="module")
def image_site() -> Iterator[str]:
    """A local web server: /image.png is the fixture image, /big.png a larger file, anything else a 404."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = {"/image.png": IMAGE, "/big.png": IMAGE * 4}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_proxy")
def test_remote_images_are_fetched_when_allowed(
    fetching_server: LiveServer, image_site: str, reference: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = client_for(fetching_server)
    reply = client.chat.completions.create(
        model="vision", messages=chat_image(image_site + "/image.png"), max_tokens=STEPS, temperature=0
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == prompt_tokens(reference, with_image())
    assert reply.choices[0].message.content == api_reply(reference, with_image())[0]
    bad_request(client, image_site + "/missing.png", "fetching the image answered HTTP 404")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    bad_request(client, f"http://127.0.0.1:{port}/image.png", "the image could not be fetched")
    bad_request(client, "http://" + "a" * 300 + ".example/image.png", "the image could not be fetched")
    # A host name IDNA cannot encode (json.dumps writes the lone surrogate as an escape, which JSON allows).
    body = json.dumps({"messages": chat_image("https://\udcff/image.png"), "max_tokens": 1})
    response = httpx.post(fetching_server.api + "/chat/completions", content=body, timeout=30)
    assert response.status_code == 400 and "the image could not be fetched" in response.json()["error"]["message"]
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 2 * len(IMAGE))
    bad_request(client, image_site + "/big.png", "larger than the")


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.binary(max_size=64)
    | st.builds(lambda cut, flips: _damaged(cut, flips), st.integers(0, len(IMAGE)), st.lists(st.integers(0, 255)))
)
def test_damaged_images_are_400s_never_500s(client: openai.OpenAI, data: bytes) -> None:
    try:
        client.chat.completions.create(model="vision", messages=chat_image(data_uri(data)), max_tokens=1)
    except openai.BadRequestError as err:
        body: Any = err.body
        assert body["message"].startswith("messages.0.content.0: "), body


def _damaged(cut: int, flips: list[int]) -> bytes:
    """The fixture image cut at `cut` bytes, with bytes past its signature changed at the positions `flips` picks."""
    data = bytearray(IMAGE[:cut])
    for flip in flips:
        if len(data) > 8:
            data[8 + flip * 7919 % (len(data) - 8)] ^= 0x5A
    return bytes(data)
