"""Stop strings over a stream split at any point."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cmpchat.engine.stop import StopStringMatcher


def run(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = "".join(matcher.feed(p) for p in pieces) + matcher.flush()
    return out, matcher.stopped


def test_stops_before_the_stop_string():
    assert run(["Hello wor", "ld. END", " more"], ["END"]) == ("Hello world. ", True)


def test_partial_match_that_fails_is_released():
    assert run(["a EN", "D", "x"], ["END!"]) == ("a ENDx", False)


def test_earliest_of_several_stop_strings_wins():
    assert run(["one two three"], ["three", "two"]) == ("one ", True)


def test_the_matcher_says_which_stop_string_stopped_it():
    def matched(pieces: list[str], stops: list[str]) -> str | None:
        matcher = StopStringMatcher(stops)
        for piece in pieces:
            matcher.feed(piece)
        return matcher.matched

    assert matched(["one, two", ". three"], ["three", ". "]) == ". "
    assert matched(["one, two."], ["two.", "two"]) == "two."  # both start at once: the first given
    assert matched(["one, two."], ["o.", "wo.", "two."]) == "two."  # completed together: the one starting first
    assert matched(["one, tw", "o"], ["two", "one, t"]) == "one, t"  # the first completed stops the stream
    assert matched(["no stop here"], ["END"]) is None


@given(st.text(alphabet="abEND ", max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_any_split_gives_the_same_result(text, cuts):
    cuts = sorted({c for c in cuts if c <= len(text)})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    expected = text.split("END")[0]
    assert run(pieces, ["END"]) == (expected, "END" in text)
