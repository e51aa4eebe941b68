"""Loading, the API key, the bounded queue, client disconnects and /metrics."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from cmpchat.errors import CmpchatError
from cmpchat.server.settings import ServerSettings
from tests.scripted_backend import FOREVER
from tests.server.conftest import API_KEY, client_for, scripted_model
from tests.server.live import live_server, metric


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_health_is_503_while_the_model_loads(tiny_model_path: Path) -> None:
    release = threading.Event()

    def slow_load():
        release.wait(10)
        return scripted_model(tiny_model_path)

    with live_server(ServerSettings(port=0), slow_load, wait_ready=False) as server:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert health.json()["error"]["type"] == "unavailable_error"
        assert httpx.get(server.url + "/v1/health").json() == health.json()
        for path in ("/props", "/slots"):
            assert httpx.get(server.url + path).status_code == 503
        chat = httpx.post(server.api + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 503 and "loading" in chat.json()["error"]["message"]
        assert metric(server.url, "cmpchat_model_loaded") == 0
        release.set()
        wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_model_that_fails_to_load_is_reported(tiny_model_path: Path) -> None:
    def broken_load():
        raise CmpchatError("not a GGUF file")

    with live_server(ServerSettings(port=0), broken_load, wait_ready=False) as server:
        wait_until(lambda: server.load_failures)
        assert server.load_failures == ["not a GGUF file"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "not a GGUF file" in health.json()["error"]["message"]


def test_api_key(tiny_model_path: Path) -> None:
    model = scripted_model(tiny_model_path)
    with live_server(ServerSettings(port=0, api_key=API_KEY), lambda: model) as server:
        assert httpx.get(server.url + "/health").status_code == 200  # open to supervisors
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "SAY:in"}]
        with pytest.raises(openai.AuthenticationError) as caught:
            client_for(server, "wrong").chat.completions.create(model="m", messages=messages)
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        for path in ("/v1/models", "/metrics", "/v1/completions", "/nothing"):
            response = httpx.request("POST" if "completions" in path else "GET", server.url + path)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        reply = client_for(server, API_KEY).chat.completions.create(model="m", messages=messages)
        assert reply.choices[0].message.content == "in"
        assert metric(server.url, "cmpchat_model_loaded", {"Authorization": f"Bearer {API_KEY}"}) == 1


def test_full_queue_answers_503_and_disconnects_free_slots(tiny_model_path: Path) -> None:
    model = scripted_model(tiny_model_path, step_delay=0.005)
    settings = ServerSettings(port=0, slots=1, max_queue=1)
    endless = {"messages": [{"role": "user", "content": "SAY:" + FOREVER}], "max_tokens": 100_000, "stream": True}
    with live_server(settings, lambda: model) as server, httpx.Client(timeout=30) as http:
        url = server.api + "/chat/completions"
        first = http.send(http.build_request("POST", url, json=endless), stream=True)
        second = http.send(http.build_request("POST", url, json=endless), stream=True)
        assert first.status_code == second.status_code == 200
        wait_until(lambda: metric(server.url, "cmpchat_requests_running") == 1)
        assert metric(server.url, "cmpchat_requests_queued") == 1

        with pytest.raises(openai.APIStatusError) as caught:
            client_for(server).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert caught.value.status_code == 503 and caught.value.code == "server_busy"
        assert caught.value.response.headers["retry-after"] == "1"

        first.close()  # the client goes away: its generation stops and the waiting request moves up
        wait_until(lambda: metric(server.url, "cmpchat_requests_queued") == 0)
        assert metric(server.url, "cmpchat_requests_running") == 1
        second.close()
        wait_until(lambda: metric(server.url, "cmpchat_requests_running") == 0)
        wait_until(lambda: model.backend.held_sequences == len(server_cache(server)))
        assert metric(server.url, 'cmpchat_requests_finished_total{reason="cancelled"}') == 2


def test_non_streaming_client_that_times_out_frees_its_slot(tiny_model_path: Path) -> None:
    model = scripted_model(tiny_model_path, step_delay=0.005)
    endless = {"messages": [{"role": "user", "content": "SAY:" + FOREVER}], "max_tokens": 100_000}
    with live_server(ServerSettings(port=0, slots=1), lambda: model) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.api + "/chat/completions", json=endless, timeout=0.5)
        wait_until(lambda: metric(server.url, "cmpchat_requests_running") == 0)
        reply = client_for(server).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "SAY:next"}]
        )
        assert reply.choices[0].message.content == "next"


def server_cache(server) -> list:
    return [None] * int(metric(server.url, "cmpchat_prefix_cache_states"))


def test_metrics_parse_as_prometheus_text(scripted_server, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "SAY:count me"}])
    response = httpx.get(scripted_server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    for name in (
        "cmpchat_prompt_tokens_per_second",
        "cmpchat_decode_tokens_per_second",
        "cmpchat_requests_running",
        "cmpchat_requests_queued",
        "cmpchat_tokens_generated",
    ):
        assert name in families, name
    assert families["cmpchat_tokens_generated"].samples[0].value > 0
    assert families["cmpchat_prompt_tokens_per_second"].samples[0].value > 0
    finished = {s.labels["reason"]: s.value for s in families["cmpchat_requests_finished"].samples}
    assert finished["stop"] >= 1


def test_cors_preflight_allows_the_headers_a_browser_client_asks_for(tiny_model_path: Path) -> None:
    model = scripted_model(tiny_model_path)
    origin = "http://localhost:3000"
    settings = ServerSettings(port=0, api_key=API_KEY, allowed_origins=(origin,))
    # What the OpenAI JS SDK's preflight asks for.
    asked = "authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,x-stainless-retry-count"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked}
    with live_server(settings, lambda: model) as server:
        url = server.api + "/chat/completions"
        response = httpx.options(url, headers=preflight)  # no API key: a preflight never carries one
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == origin
        allowed = {name.strip().lower() for name in response.headers["access-control-allow-headers"].split(",")}
        assert allowed >= set(asked.split(","))
        assert httpx.options(url, headers={**preflight, "Origin": "http://elsewhere.example"}).status_code == 400
        body = {"messages": [{"role": "user", "content": "SAY:from a page"}]}
        reply = httpx.post(url, json=body, headers={"Origin": origin, "Authorization": f"Bearer {API_KEY}"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == origin
