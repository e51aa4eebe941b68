"""Stopping the server (SIGTERM, or Ctrl+C's SIGINT) with requests in flight: those that end within the grace
period end as usual; the rest are ended, a stream with an error event and `[DONE]` (a Responses stream with
`response.failed`, a Messages stream with Anthropic's `error` event), a plain request with a JSON 503, before the
connections close."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.scripted_backend import FOREVER
from tests.server.live import metric, wait_for

GRACE_SECONDS = 1.0
REPO = Path(__file__).parents[2]


@pytest.fixture
def served(tiny_model_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.server.serve_scripted", str(tiny_model_path), "--grace", str(GRACE_SECONDS)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def chat(text: str, **fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "SAY:" + text}], **fields}


def sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stopping_the_server_answers_every_request_in_flight(
    served: tuple[subprocess.Popen[str], str], signum: signal.Signals
) -> None:
    process, url = served
    with httpx.Client(base_url=url, timeout=30) as http, ThreadPoolExecutor(2) as pool:
        wait_for(lambda: http.get("/health").status_code == 200, "the model to load")
        endless = http.send(
            http.build_request("POST", "/v1/chat/completions", json=chat(FOREVER, max_tokens=100_000, stream=True)),
            stream=True,
        )
        plain = pool.submit(
            httpx.post, url + "/v1/chat/completions", json=chat(FOREVER, max_tokens=100_000), timeout=30
        )
        # About 0.1 s of decoding: it ends within the grace period.
        short = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "SAY:" + FOREVER, "max_tokens": 20})
        wait_for(lambda: metric(url, "cmpchat_requests_running") == 3, "three requests to run")
        process.send_signal(signum)

        events = sse_events(endless)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "unavailable_error" and "shutting down" in error["message"]
        assert all("choices" in json.loads(event) for event in events[:-2])

        refused = plain.result()
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "unavailable_error"
        assert "shutting down" in refused.json()["error"]["message"]

        finished = short.result()
        assert finished.status_code == 200, finished.text
        assert finished.json()["choices"][0]["finish_reason"] == "length"
    process.wait(timeout=10)


def test_stopping_the_server_ends_responses_and_messages_streams_in_their_apis_shapes(
    served: tuple[subprocess.Popen[str], str],
) -> None:
    process, url = served
    endless = "SAY:" + FOREVER
    with httpx.Client(base_url=url, timeout=30) as http:
        wait_for(lambda: http.get("/health").status_code == 200, "the model to load")
        response = http.send(
            http.build_request(
                "POST", "/v1/responses", json={"input": endless, "max_output_tokens": 100_000, "stream": True}
            ),
            stream=True,
        )
        message = http.send(
            http.build_request(
                "POST",
                "/v1/messages",
                json={"messages": [{"role": "user", "content": endless}], "max_tokens": 100_000, "stream": True},
            ),
            stream=True,
        )
        wait_for(lambda: metric(url, "cmpchat_requests_running") == 2, "both requests to run")
        process.send_signal(signal.SIGTERM)

        failed = json.loads(sse_events(response)[-1])
        assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
        assert "shutting down" in failed["response"]["error"]["message"]

        lines = [line for line in message.iter_lines() if line]
        assert lines[-2] == "event: error"
        error = json.loads(lines[-1].removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        assert "shutting down" in error["error"]["message"]
    process.wait(timeout=10)
