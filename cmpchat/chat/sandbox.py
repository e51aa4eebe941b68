"""A Jinja sandbox for chat templates, which arrive inside downloaded model files and are untrusted.

The environment matches what Hugging Face templates are written against (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text as is), and
every failure (syntax, an exception the template raises, a forbidden operation, anything else) comes out
as one `CmpchatError` line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.ext import loopcontrols
from jinja2.runtime import Context, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cmpchat.errors import CmpchatError

_MAX_REPEAT_LEN = 1 << 20
"""Longest string or list a template may build with `*`: enough for any prompt, too small to exhaust memory."""

_MAX_POWER_BITS = 4096
"""Largest result, in bits, of `**` on integers."""


class TemplateRaised(Exception):
    """What `raise_exception(message)` throws inside a template."""


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, made strict about unsafe attributes and about memory-hungry operators."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        # Jinja's default returns an undefined that prints as "" and only fails when used further,
        # so `{{ x.__class__ }}` would pass silently; fail at the access instead.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_repeat(left, right)
            _check_repeat(right, left)
        elif operator == "**" and _power_too_large(left, right):
            raise SecurityError("the result of ** would be too large")
        return super().call_binop(context, operator, left, right)


def _check_repeat(sequence: Any, count: Any) -> None:
    if isinstance(sequence, str | list | tuple) and isinstance(count, int) and len(sequence) * count > _MAX_REPEAT_LEN:
        raise SecurityError("the result of * would be too large")


def _power_too_large(base: Any, exponent: Any) -> bool:
    if not (isinstance(base, int) and isinstance(exponent, int)) or abs(base) <= 1:
        return False
    return abs(base).bit_length() * exponent > _MAX_POWER_BITS


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; a prompt must see the text unchanged.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox; a syntax error becomes a `CmpchatError`."""
    env = _ChatTemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise CmpchatError(
            f"chat template has a syntax error at line {err.lineno}: {_one_line(err.message or '')}"
        ) from err


def render_template(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    """Render a compiled chat template; whatever goes wrong inside becomes a `CmpchatError`."""
    try:
        return template.render(**variables)
    except TemplateRaised as err:
        raise CmpchatError(f"chat template refused the conversation: {_one_line(str(err))}") from err
    except SecurityError as err:
        raise CmpchatError(f"chat template tried a forbidden operation: {_one_line(str(err))}") from err
    except jinja2.TemplateError as err:
        raise CmpchatError(f"chat template failed: {_one_line(str(err))}") from err
    except Exception as err:  # the template is foreign code: a TypeError in it is its bug, not ours
        raise CmpchatError(f"chat template failed: {type(err).__name__}: {_one_line(str(err))}") from err
