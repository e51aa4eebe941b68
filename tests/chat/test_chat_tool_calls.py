"""Parsing one tool call body, in the XML-like and the JSON form, with schema-typed arguments."""

from __future__ import annotations

import math

import pytest

from cmpchat.chat.tool_calls import convert_value, parameter_types, parse_tool_call

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "filters": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                    "level": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "bare"}},
]
TYPES = parameter_types(TOOLS)


def test_parameter_types() -> None:
    assert TYPES["search"]["query"] == {"string"}
    assert TYPES["search"]["note"] == {"string", "null"}
    assert TYPES["search"]["level"] == {"integer", "string"}
    assert TYPES["bare"] == {}
    assert parameter_types(None) == {}


def test_xml_form_with_schema() -> None:
    body = (
        "\n<function=search>\n"
        "<parameter=query>\n42\n</parameter>\n"
        "<parameter=limit>\n5\n</parameter>\n"
        '<parameter=filters>\n{"lang": "en"}\n</parameter>\n'
        "<parameter=note>\nnull\n</parameter>\n"
        "<parameter=level>\nhigh\n</parameter>\n"
        "</function>\n"
    )
    assert parse_tool_call(body, TYPES) == (
        "search",
        {"query": "42", "limit": 5, "filters": {"lang": "en"}, "note": None, "level": "high"},
    )


def test_xml_values_keep_inner_newlines_and_lose_one_outer() -> None:
    body = "<function=write>\n<parameter=text>\n\nline 1\nline 2\n\n</parameter>\n</function>"
    assert parse_tool_call(body, {}) == ("write", {"text": "\nline 1\nline 2\n"})


def test_xml_missing_closing_tags() -> None:
    body = "<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n"
    assert parse_tool_call(body, {}) == ("f", {"a": 1, "b": "x"})
    assert parse_tool_call("<function=g>\n", {}) == ("g", {})


@pytest.mark.parametrize(
    "body",
    [
        "just words",
        "<function=f>\nstray text\n<parameter=a>\n1\n</parameter>\n</function>",
        "<function=f>\n</function>\ntrailing",
        "{not json}",
        '{"arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "not json"}',
    ],
)
def test_malformed_bodies(body: str) -> None:
    assert parse_tool_call(body, {}) is None


def test_json_form() -> None:
    assert parse_tool_call('\n{"name": "f", "arguments": {"a": [1, 2]}}\n', {}) == ("f", {"a": [1, 2]})
    assert parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 1}"}', {}) == ("f", {"a": 1})
    assert parse_tool_call('{"name": "f"}', {}) == ("f", {})


@pytest.mark.parametrize(
    ("raw", "types", "value"),
    [
        ("5", frozenset(), 5),
        ("5", frozenset({"string"}), "5"),
        ("true", frozenset(), True),
        ("true", frozenset({"integer", "string"}), "true"),
        ("7", frozenset({"integer", "string"}), 7),
        ("null", frozenset({"string", "null"}), None),
        ('"quoted"', frozenset(), "quoted"),
        ('"quoted"', frozenset({"string", "null"}), '"quoted"'),
        ("hello", frozenset({"integer"}), "hello"),
        ("1.5", frozenset({"number"}), 1.5),
        ("NaN", frozenset(), "NaN"),
        ("[1, 2", frozenset(), "[1, 2"),
    ],
)
def test_convert_value(raw: str, types: frozenset[str], value: object) -> None:
    converted = convert_value(raw, types)
    assert converted == value and type(converted) is type(value)
    assert not (isinstance(converted, float) and math.isnan(converted))
