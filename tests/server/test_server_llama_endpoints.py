"""llama-server's own endpoints, in its request and response shapes: /tokenize, /detokenize, /apply-template,
/props, /slots and /v1/health, and its `X-Api-Key` header."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cmpchat import __version__
from cmpchat.chat.messages import Message
from cmpchat.engine.reply import GenerationOptions
from cmpchat.server.settings import ServerSettings
from cmpchat.server.slots import SlotHolder, SlotTable
from tests.scripted_backend import FOREVER
from tests.server.conftest import API_KEY, scripted_model
from tests.server.live import LiveServer, live_server, metric, wait_for


def post(server: LiveServer, path: str, body: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def assert_400(response: httpx.Response, fragment: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"], error


def test_tokenize_parses_special_tokens_unless_told_not_to(scripted_server: LiveServer) -> None:
    model = scripted_server.served
    text = "Hello<|im_end|> world"
    assert post(scripted_server, "/tokenize", {"content": text}).json() == {
        "tokens": model.tokenize(text, parse_special=True)
    }
    plain = post(scripted_server, "/tokenize", {"content": text, "parse_special": False, "add_special": True})
    assert plain.json() == {"tokens": model.tokenize(text, parse_special=False)}
    assert plain.json() != {"tokens": model.tokenize(text, parse_special=True)}


def test_tokenize_with_pieces_gives_text_or_the_bytes_that_are_not_text(scripted_server: LiveServer) -> None:
    model = scripted_server.served
    text = "a é 😀"
    tokens = post(scripted_server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [token["id"] for token in tokens] == model.tokenize(text, parse_special=True)
    raw = b""
    for token in tokens:
        piece = token["piece"]
        expected = model.tokenizer.token_bytes(token["id"])
        if isinstance(piece, str):
            assert piece.encode() == expected
        else:  # not valid UTF-8 on its own: the byte values
            assert bytes(piece) == expected
            with pytest.raises(UnicodeDecodeError):
                expected.decode()
        raw += expected
    assert raw.decode() == text
    assert any(isinstance(token["piece"], list) for token in tokens)  # the byte vocabulary splits é and 😀


def test_detokenize(scripted_server: LiveServer) -> None:
    model = scripted_server.served
    ids = model.tokenize("round <|im_end|> trip", parse_special=True)
    assert post(scripted_server, "/detokenize", {"tokens": ids}).json() == {"content": "round <|im_end|> trip"}
    assert post(scripted_server, "/detokenize", {"tokens": []}).json() == {"content": ""}
    vocab = model.tokenizer.vocab_size
    assert_400(post(scripted_server, "/detokenize", {"tokens": [vocab]}), f"0..{vocab - 1}")
    assert_400(post(scripted_server, "/detokenize", {"tokens": [-1]}), f"0..{vocab - 1}")
    assert_400(post(scripted_server, "/detokenize", {}), "tokens")


def test_apply_template_returns_the_prompt_a_chat_request_would_read(scripted_server: LiveServer) -> None:
    model = scripted_server.served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    response = post(scripted_server, "/apply-template", {"messages": messages})
    expected = model.render([Message("system", "Be brief."), Message("user", "Hi")]).text
    assert response.json() == {"prompt": expected}

    tool = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
    with_tools = post(scripted_server, "/apply-template", {"messages": messages, "tools": [tool]}).json()["prompt"]
    assert "get_time" in with_tools and "get_time" not in expected
    no_thinking = post(
        scripted_server,
        "/apply-template",
        {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()["prompt"]
    assert (
        no_thinking == model.render([Message("system", "Be brief."), Message("user", "Hi")], enable_thinking=False).text
    )

    assert_400(post(scripted_server, "/apply-template", {"messages": []}), "messages")
    late_system = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    assert_400(post(scripted_server, "/apply-template", {"messages": late_system}), "system message")


def test_props(scripted_server: LiveServer) -> None:
    model = scripted_server.served
    props = httpx.get(scripted_server.url + "/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == model.backend.context_limit
    params = settings["params"]
    assert (params["temperature"], params["top_p"], params["top_k"]) == pytest.approx((0.7, 0.8, 20))
    assert params["n_predict"] == params["max_tokens"] == 4096 and params["seed"] == -1 and params["stop"] == []
    assert props["total_slots"] == 4
    assert props["model_alias"] == "scripted"
    assert props["model_path"] == str(model.path)
    assert props["chat_template"] == model.chat_format.source
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["build_info"] == f"cmpchat {__version__}"
    assert props["is_sleeping"] is False


@pytest.fixture(scope="module")
def slow_server(tiny_model_path: Path) -> Iterator[LiveServer]:
    model = scripted_model(tiny_model_path, step_delay=0.005)
    with live_server(ServerSettings(port=0, slots=2, model_name="slow"), lambda: model) as server:
        server.model = model
        yield server


def slots(server: LiveServer, query: str = "") -> list[dict]:
    response = httpx.get(server.url + "/slots" + query)
    assert response.status_code == 200, response.text
    return response.json()


def test_slots_show_the_requests_that_hold_them(slow_server: LiveServer) -> None:
    idle = slots(slow_server)
    assert [slot["id"] for slot in idle] == [0, 1]
    assert all(not slot["is_processing"] and slot["id_task"] == -1 for slot in idle)
    assert idle[0]["n_ctx"] == slow_server.served.backend.context_limit
    assert idle[0]["params"]["temperature"] == pytest.approx(0.7)

    body = {
        "messages": [{"role": "user", "content": "SAY:one\ntwo " + FOREVER}],
        "max_tokens": 100_000,
        "temperature": 0.25,
        "stop": ["never"],
        "stream": True,
    }
    with httpx.Client(timeout=30) as http:
        stream = http.send(http.build_request("POST", slow_server.api + "/chat/completions", json=body), stream=True)
        wait_for(lambda: any(slot["next_token"]["n_decoded"] > 8 for slot in slots(slow_server)), "decoding")
        busy = [slot for slot in slots(slow_server) if slot["is_processing"]]
        assert len(busy) == 1 and busy[0]["id"] == 0 and busy[0]["id_task"] >= 1
        assert busy[0]["params"]["temperature"] == pytest.approx(0.25) and busy[0]["params"]["stop"] == ["never"]
        next_token = busy[0]["next_token"]
        assert next_token["has_next_token"] and next_token["has_new_line"]
        assert next_token["n_remain"] == 100_000 - next_token["n_decoded"]
        assert slots(slow_server, "?fail_on_no_slot=1")  # one is still free
        stream.close()
    wait_for(lambda: not any(slot["is_processing"] for slot in slots(slow_server)), "the slot to be free")


def test_a_slot_table_takes_the_lowest_free_slot_and_shows_a_late_ending_as_an_extra_row() -> None:
    table = SlotTable(2)
    first, second, third = (SlotHolder(task, GenerationOptions()) for task in (1, 2, 3))
    table.take(first)
    table.take(second)
    table.take(third)  # the engine freed a slot whose holder's Finished is not read yet
    assert table.holders() == [first, second, third]
    table.give_back(first)
    assert table.holders() == [None, second, third]
    table.give_back(third)
    assert table.holders() == [None, second]
    table.take(third)
    assert table.holders() == [third, second]


def test_slots_fail_on_no_slot_is_503_when_every_slot_is_busy(slow_server: LiveServer) -> None:
    endless = {"messages": [{"role": "user", "content": "SAY:" + FOREVER}], "max_tokens": 100_000, "stream": True}
    with httpx.Client(timeout=30) as http:
        streams = [
            http.send(http.build_request("POST", slow_server.api + "/chat/completions", json=endless), stream=True)
            for _ in range(2)
        ]
        wait_for(lambda: all(slot["is_processing"] for slot in slots(slow_server)), "both slots to be taken")
        response = httpx.get(slow_server.url + "/slots?fail_on_no_slot=1")
        assert response.status_code == 503 and response.json()["error"]["type"] == "unavailable_error"
        for stream in streams:
            stream.close()
    wait_for(lambda: metric(slow_server.url, "cmpchat_requests_running") == 0, "the slots to be free")


def test_v1_health_is_health(scripted_server: LiveServer) -> None:
    assert httpx.get(scripted_server.url + "/v1/health").json() == {"status": "ok"}


def test_x_api_key_is_accepted_beside_bearer(tiny_model_path: Path) -> None:
    model = scripted_model(tiny_model_path)
    with live_server(ServerSettings(port=0, api_key=API_KEY), lambda: model) as server:
        assert httpx.get(server.url + "/v1/health").status_code == 200  # open, as /health is
        for path in ("/props", "/slots"):
            assert httpx.get(server.url + path).status_code == 401
            assert httpx.get(server.url + path, headers={"X-Api-Key": "wrong"}).status_code == 401
            assert httpx.get(server.url + path, headers={"X-Api-Key": API_KEY}).status_code == 200
        response = httpx.post(server.url + "/tokenize", json={"content": "hi"}, headers={"x-api-key": API_KEY})
        assert response.status_code == 200 and response.json()["tokens"]
        refused = httpx.post(server.url + "/detokenize", json={"tokens": []})
        assert refused.status_code == 401 and "X-Api-Key" in refused.json()["error"]["message"]
