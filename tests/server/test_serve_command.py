"""`cmpchat serve` as a command: its options, and the one-line errors users can hit before serving."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from cmpchat.commands import serve
from cmpchat.errors import CmpchatError
from cmpchat.server.runner import bind, is_loopback
from tests.vision.vision_fixtures import MMPROJ_F32, ORACLE


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_defaults_listen_on_loopback() -> None:
    settings = serve.settings_from_args(parse())
    assert (settings.host, settings.port, settings.slots, settings.api_key) == ("127.0.0.1", 8080, 4, None)
    assert is_loopback(settings.host) and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


def test_options_reach_the_settings(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    args = parse(
        "--slots", "8", "--queue", "3", "--api-key-file", str(key_file), "--alias", "qwen", "--cache-states", "0"
    )
    settings = serve.settings_from_args(args)
    assert (settings.slots, settings.max_queue, settings.api_key, settings.model_name) == (8, 3, "s3cret", "qwen")
    assert settings.prefix_cache_entries == 0
    assert not settings.allow_remote_images
    assert serve.settings_from_args(parse("--allow-remote-images")).allow_remote_images
    assert parse("--mmproj", "mmproj.gguf").mmproj == "mmproj.gguf"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--slots", "0"), "slots must be >= 1"),
        (("--port", "70000"), "port must be in"),
        (("--api-key", ""), "api-key must not be empty"),
        (("--api-key-file", "/nonexistent/key"), "cannot read the API key file"),
    ],
)
def test_bad_options_are_one_line_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(CmpchatError, match=message):
        serve.settings_from_args(parse(*argv))


def test_a_busy_port_is_a_clear_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(CmpchatError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind("127.0.0.1", port)


def test_a_model_that_cannot_load_ends_the_command(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    with pytest.raises(CmpchatError, match="the model failed to load"):
        serve.run(parse("-m", str(missing), "--port", "0"))


def test_a_projector_of_another_width_ends_the_command_in_one_line() -> None:
    model = ORACLE / "tiny_untied.f32.gguf"
    args = parse("-m", str(model), "--backend", "cpu", "--mmproj", str(MMPROJ_F32), "--port", "0")
    with pytest.raises(CmpchatError, match="projects images to width 32, but the model's hidden size is 64") as caught:
        serve.run(args)
    assert str(caught.value).startswith("the model failed to load: ") and "\n" not in str(caught.value)
