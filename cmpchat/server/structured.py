"""Structured output: the grammars that `response_format` and a forced `tool_choice` ask for, which the engine
enforces by constrained decoding (`cmpchat.engine.constraint`).

- `json_object`: any JSON object; `json_schema`: JSON text the schema validates.
- `tool_choice` "required" or a named function: one tool call in the form the chat template teaches, then the
  end of the reply. Qwen3.5's XML-like form (`<function=NAME>`, one `<parameter=ARG>` block per argument, in the
  schema's order, optional ones may be left out) has each non-string argument written as JSON its schema
  validates and each string argument as raw text (an enum's values, or up to `maxLength` characters, never
  containing `</parameter>`). A tool with a string argument whose schema says more than that (a pattern, a
  format, a union with other types), or a template that teaches the JSON form, gets the JSON form
  `{"name": ..., "arguments": {...}}`, which the output parser reads as well; its arguments are the declared
  parameters only, unless the schema sets `additionalProperties` itself. One call per reply.

When the prompt opens a `<think>` block, the grammar lets the reply think first (any text up to `</think>`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from cmpchat.api import Model
from cmpchat.chat.messages import Message, Tool, ToolCall
from cmpchat.engine.constraint import GrammarError, check_grammar, json_schema_grammar, lark_grammar
from cmpchat.engine.request import GenerationRequest
from cmpchat.server.errors import ApiError

ANY_OBJECT: dict[str, Any] = {"type": "object"}

_THINKING = r"""
THINKING: /(?s:.*)/ & ~/(?s:.*)<\/think>(?s:.*)/
thought: THINKING "</think>" /\s*/
"""
_STRING_WORDS = frozenset({"type", "enum", "const", "minLength", "maxLength", "description", "title", "default"})


def constrained(
    generation: GenerationRequest,
    model: Model,
    *,
    schema: Mapping[str, Any] | None,
    where: str,
    tools: Sequence[Tool] | None = None,
) -> GenerationRequest:
    """`generation` with the grammar of a reply that is JSON `schema` validates (a 400 naming `where` when it
    cannot be enforced) or, without a schema, one call of `tools`."""
    thinking = generation.starts_in_reasoning
    if schema is not None:
        grammar = json_grammar(schema, model, thinking=thinking, where=where)
    else:
        assert tools, "a forced tool choice has tools"
        grammar = tool_call_grammar(tools, model, thinking=thinking)
    return dataclasses.replace(generation, options=dataclasses.replace(generation.options, grammar=grammar))


def json_grammar(schema: Mapping[str, Any], model: Model, *, thinking: bool, where: str) -> str:
    """The grammar of a reply that is JSON text `schema` validates (after a thought when `thinking`); an
    unusable schema is a 400 naming `where`."""
    try:
        if not thinking:
            grammar = json_schema_grammar(dict(schema))
        else:
            grammar = lark_grammar(f"start: thought %json {_schema_text(schema)}\n{_THINKING}")
        check_grammar(grammar, model.tokenizer)
    except GrammarError as err:
        raise ApiError(400, f"{where}: {err}", param=where) from None
    return grammar


def tool_call_grammar(tools: Sequence[Tool], model: Model, *, thinking: bool) -> str:
    """The grammar of a reply that is one call of one of `tools` (already narrowed to a named choice)."""
    xml = _teaches_xml_calls(model, tools)
    calls = []
    rules: list[str] = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        parameters = function.get("parameters") or ANY_OBJECT
        name = function["name"]
        if xml and _xml_writable(parameters):
            calls.append(_xml_call(index, name, parameters, rules))
        else:
            # Only the declared parameters, as in the XML form (else a weak model invents keys until its limit).
            arguments = {"additionalProperties": False, **parameters}
            opening = _literal('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
            calls.append(f'{opening} %json {_schema_text(arguments)} "}}"')
    body = " | ".join(f"call_{i}" for i in range(len(calls)))
    lines = [f'start: {"thought " if thinking else ""}"<tool_call>\\n" ({body}) "\\n</tool_call>"']
    lines += [f"call_{i}: {call}" for i, call in enumerate(calls)]
    lines += rules
    text = "\n".join(lines) + ("\n" + _THINKING if thinking else "\n")
    try:
        grammar = lark_grammar(text)
        check_grammar(grammar, model.tokenizer)
    except GrammarError as err:
        raise ApiError(400, f"tools: a parameter schema cannot be enforced: {err}", param="tools") from None
    return grammar


def _xml_call(index: int, name: str, parameters: Mapping[str, Any], rules: list[str]) -> str:
    """The rule body of one XML-form call, adding a rule per argument to `rules`."""
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())  # a list of names: `_xml_writable` checked it
    parts = []
    for position, (argument, schema) in enumerate(properties.items()):
        rule = f"arg_{index}_{position}"
        opening = _literal(f"<parameter={argument}>\n")
        rules.append(f'{rule}: {opening} {_value(schema, rule.upper(), rules)} "\\n</parameter>\\n"')
        parts.append(rule if argument in required else f"{rule}?")
    return " ".join([_literal(f"<function={name}>\n"), *parts, '"</function>"'])


def _value(schema: Mapping[str, Any], terminal: str, rules: list[str]) -> str:
    """An argument's value in the XML form: raw text for a string (a terminal named `terminal`, added to
    `rules`), JSON for anything else."""
    if schema.get("type") != "string":
        return f"%json {_schema_text(schema)}"
    if "const" in schema:
        return _literal(str(schema["const"]))
    if "enum" in schema:
        return "(" + " | ".join(_literal(str(value)) for value in schema["enum"]) + ")"
    shortest = int(schema.get("minLength", 0))
    longest = str(int(schema["maxLength"])) if "maxLength" in schema else ""
    rules.append(f"{terminal}: /(?s:.{{{shortest},{longest}}})/ & ~/(?s:.*)<\\/parameter>(?s:.*)/")
    return terminal


def _xml_writable(parameters: Mapping[str, Any]) -> bool:
    """Whether every argument is either not a string at all or a string the raw-text rule can bound."""
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not isinstance(properties, Mapping) or not isinstance(required, list):
        return False
    if any(not isinstance(name, str) for name in [*properties, *required]):
        return False
    for schema in properties.values():
        if not isinstance(schema, Mapping):
            return False
        if schema.get("type") == "string":
            if not set(schema) <= _STRING_WORDS or not _simple_string(schema):
                return False
        elif _may_be_string(schema):
            return False
    return True


def _simple_string(schema: Mapping[str, Any]) -> bool:
    """Whether a string schema's enum, const and lengths are what the raw-text rule can write."""
    enum = schema.get("enum", [""])
    lengths = [schema[key] for key in ("minLength", "maxLength") if key in schema]
    return (
        isinstance(enum, list)
        and all(isinstance(value, str) for value in enum)
        and isinstance(schema.get("const", ""), str)
        and all(type(length) is int and length >= 0 for length in lengths)
    )


def _may_be_string(schema: Mapping[str, Any]) -> bool:
    """Whether a non-"string" schema still allows strings (the parser would keep such a value raw)."""
    declared = schema.get("type")
    if declared is None:
        return True
    return isinstance(declared, list) and "string" in declared


def _teaches_xml_calls(model: Model, tools: Sequence[Tool]) -> bool:
    """Whether the chat template writes tool calls in the XML-like form (it renders a stand-in call so)."""
    call = ToolCall(name=tools[0]["function"]["name"], arguments={"x": 1}, id="call_0")
    messages = [Message("user", "?"), Message("assistant", "", tool_calls=[call])]
    try:
        text = model.render(messages, tools=tools, enable_thinking=False).text
    except Exception:  # a template that cannot render the stand-in: the JSON form, which the parser also reads
        return False
    return f"<function={call.name}>" in text


def _schema_text(schema: Mapping[str, Any]) -> str:
    """A schema for `%json`, compact (no optional whitespace, which a weak model fills with newlines)."""
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}}, ensure_ascii=False)


def _literal(text: str) -> str:
    """A Lark string literal of `text` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)
