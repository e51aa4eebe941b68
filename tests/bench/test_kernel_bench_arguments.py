"""The micro-benchmarks' shape arguments: no names means the defaults, an unknown name is refused in one line."""

from __future__ import annotations

import argparse

import pytest

from cmpchat.bench.kernels import add_shapes_argument


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_shapes_argument(parser, ["0.8B", "9B", "27B"], ["9B", "27B"])
    parser.add_argument("--tokens", nargs="*", type=int, default=[1])
    return parser


def test_no_names_gives_the_defaults() -> None:
    assert _parser().parse_args(["--tokens", "1", "4"]).models == ["9B", "27B"]


def test_names_are_kept_in_order() -> None:
    assert _parser().parse_args(["27B", "0.8B"]).models == ["27B", "0.8B"]


def test_an_unknown_name_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["70B"])
    assert "unknown model shape '70B'" in capsys.readouterr().err
