"""Parsing the body of one `<tool_call>…</tool_call>` block into a function name and typed arguments.

Two forms are understood:
- Qwen3.5's XML-like form, `<function=NAME>` then `<parameter=ARG>\\nVALUE\\n</parameter>` blocks then
  `</function>`. A missing `</parameter>` ends at the next `<parameter=` or `</function>`, and a missing
  `</function>` at the end of the body, since models do drop closing tags now and then.
- JSON, `{"name": ..., "arguments": {...}}` (older Qwen models; `arguments` may also be a JSON string).

A parameter value loses one leading and one trailing newline. It becomes a JSON value when it parses as
JSON and the tool's schema does not say it is a string; otherwise it stays the raw string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from cmpchat.chat.messages import Tool

_FUNCTION_OPEN = re.compile(r"<function=([^>\n]+)>")
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]+)>")
_PARAMETER_CLOSE = "</parameter>"
_FUNCTION_CLOSE = "</function>"

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}

ParameterTypes = Mapping[str, Mapping[str, frozenset[str]]]
"""Per function name, per parameter name, the JSON schema types the parameter allows."""


def parameter_types(tools: Sequence[Tool] | None) -> dict[str, dict[str, frozenset[str]]]:
    """Collect the declared JSON types of every tool's parameters (empty set: the schema does not say)."""
    result: dict[str, dict[str, frozenset[str]]] = {}
    for tool in tools or ():
        function = tool.get("function", tool)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        result[function["name"]] = {
            name: _schema_types(schema) for name, schema in (properties or {}).items() if isinstance(schema, Mapping)
        }
    return result


def _schema_types(schema: Mapping[str, Any]) -> frozenset[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list):
        return frozenset(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            return frozenset().union(*(_schema_types(o) for o in options if isinstance(o, Mapping)))
    return frozenset()


def parse_tool_call(body: str, types: ParameterTypes) -> tuple[str, dict[str, Any]] | None:
    """Parse a tool call body (the text between the tags); None when it is in neither form."""
    body = body.strip()
    if body.startswith("{"):
        return _parse_json_call(body)
    return _parse_xml_call(body, types)


def _parse_json_call(body: str) -> tuple[str, dict[str, Any]] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], arguments


def _parse_xml_call(body: str, types: ParameterTypes) -> tuple[str, dict[str, Any]] | None:
    opening = _FUNCTION_OPEN.match(body)
    if opening is None:
        return None
    name = opening.group(1).strip()
    rest = body[opening.end() :]
    function_end = rest.find(_FUNCTION_CLOSE)
    if function_end >= 0:
        if rest[function_end + len(_FUNCTION_CLOSE) :].strip():
            return None
        rest = rest[:function_end]
    declared = types.get(name, {})
    arguments: dict[str, Any] = {}
    while rest.strip():
        parameter = _PARAMETER_OPEN.match(rest.lstrip())
        if parameter is None:
            return None
        rest = rest.lstrip()[parameter.end() :]
        value, rest = _take_value(rest)
        argument = parameter.group(1).strip()
        arguments[argument] = convert_value(value, declared.get(argument, frozenset()))
    return name, arguments


def _take_value(text: str) -> tuple[str, str]:
    """Split `text` after a `<parameter=…>` into the raw value and what follows its end."""
    close = text.find(_PARAMETER_CLOSE)
    next_open = _PARAMETER_OPEN.search(text)
    if close >= 0 and (next_open is None or close < next_open.start()):
        value, rest = text[:close], text[close + len(_PARAMETER_CLOSE) :]
    elif next_open is not None:
        value, rest = text[: next_open.start()], text[next_open.start() :]
    else:
        value, rest = text, ""
    value = value.removeprefix("\n").removesuffix("\n")
    return value, rest


def convert_value(raw: str, types: frozenset[str]) -> Any:
    """Type one parameter value: JSON when it parses and `types` (the schema's) allow it, else the string."""
    if types == {"string"}:
        return raw
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return raw
    if "string" not in types:
        return value
    return value if _matches(value, types - {"string"}) else raw


def _matches(value: Any, types: frozenset[str]) -> bool:
    for name in types:
        allowed = _JSON_TYPES.get(name, ())
        if isinstance(value, bool) and bool not in allowed:
            continue  # JSON true is not an integer, although Python's bool is an int
        if isinstance(value, allowed):
            return True
    return False


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; a value spelled that way is text.
    raise ValueError(name)
