"""A bounded load test over loopback: a few hundred streamed requests against the tiny model."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.live import LiveServer
from tests.server.loadgen import run_load


def test_bounded_load(tiny_server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    report = asyncio.run(run_load(tiny_server.api, requests=200, concurrency=16, max_tokens=16))
    with capsys.disabled():
        print("\n" + report.summary("tiny model, in-process server, 4 slots, 16 clients, 16 tokens"))
    assert report.failures == []
    assert len(report.latencies) == 200
    assert report.completion_tokens > 0
