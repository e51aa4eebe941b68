"""OpenAI's Responses API: `POST /v1/responses` (and `/responses`), the API that OpenAI's Agents SDK and Codex use.

Request: `input`, a string (one user message) or a list of items: messages (`role` user, assistant, system or
developer; `content` a string or `input_text` / `output_text` parts, and in user messages `input_image` parts by
`image_url`, read as `server/images.py` says), `function_call` items (an earlier call of the
assistant's), `function_call_output` items (a tool's result, by `call_id`) and `reasoning` items (earlier thinking,
given to the next assistant turn); `instructions` (the system message, joined with the system and developer
messages the input opens with); `tools` (`function` tools only) and `tool_choice` (`auto`, `none`, `required` or
`{"type": "function", "name"}`: `required` and a named choice are enforced by a grammar, and a named choice offers
only that tool); `text.format` `text`, `json_object` or `json_schema` (`schema`; structured output, as chat's
`response_format`, `server/structured.py`); `max_output_tokens`, `temperature`, `top_p`; `reasoning.effort`, mapped
onto the model's thinking switch: `none` and `minimal` turn thinking off, `low` to `max` turn it on, none leaves the
template's default (off for structured output); `include: ["message.output_text.logprobs"]` and `top_logprobs`
(0 to 20; set alone, it asks for them too) for log-probabilities, as chat's (OpenAI's other `include` values name
outputs this server never makes: they add nothing). Refused (400): `previous_response_id` and `conversation`
(nothing is stored: send the whole conversation), other `text.format` types, unknown `include` values, images by
`file_id`, file and audio input, tool types other than `function`.

Response: a `response` object whose `output` holds a `reasoning` item (its text as a `reasoning_text` part), a
`message` item with one `output_text` part (its `logprobs`, when asked for: chat's entries, of the answer's tokens
alone), and a `function_call` item per tool call; `status` `completed`, or
`incomplete` with `incomplete_details.reason` `max_output_tokens`; `usage` and llama-server's `timings`.

Streamed (`stream: true`): typed server-sent events, each `event: <type>` and a JSON `data` with a `sequence_number`:
`response.created`, `response.in_progress`; for each item `response.output_item.added`, then for reasoning
`response.content_part.added`, `response.reasoning_text.delta`..., `response.reasoning_text.done`,
`response.content_part.done`, for text the same with `response.output_text.delta` / `.done` (each with the
`logprobs` of the tokens whose text it is the first to carry; `.done` with all of the part's), for a tool call
`response.function_call_arguments.delta` and `.done`, then `response.output_item.done`; last `response.completed`
(or `response.incomplete`), or `response.failed` when generation fails. No `[DONE]`: OpenAI sends none.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import anyio
from pydantic import Discriminator, Field, Tag
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cmpchat.api import Model
from cmpchat.chat.messages import ImagePart, Message, TextPart, Tool, ToolCall
from cmpchat.engine.request import EngineEvent
from cmpchat.server import structured
from cmpchat.server.blocks import BlockClosed, BlockEvent, BlockOpened, BlockSplitter, BlockText
from cmpchat.server.errors import ApiError
from cmpchat.server.generation import serve
from cmpchat.server.guard import read_json
from cmpchat.server.images import ImageReader
from cmpchat.server.logprobs import LogprobShapes
from cmpchat.server.prepare import PreparedRequest, conversation_request, generation_options, tool_call
from cmpchat.server.responses import Outcome, named_sse
from cmpchat.server.runtime import Runtime
from cmpchat.server.schemas import Body, parse_body
from cmpchat.server.settings import ServerSettings

_MAX_INT64 = 2**63 - 1


class TextContent(Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalContent(Body):
    type: Literal["refusal"]
    refusal: str


class ImageContent(Body):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class MediaContent(Body):
    type: Literal["input_file", "input_audio"]


MessageContent = Annotated[TextContent | RefusalContent | ImageContent | MediaContent, Field(discriminator="type")]


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[MessageContent]


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str = ""
    output: str | list[MessageContent]


class ReasoningText(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Body):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = []


def _item_type(value: Any) -> str | None:
    # A message item may leave out its type (OpenAI's "easy" input message).
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_item",
        custom_error_message="an input item is a message, function_call, function_call_output or reasoning item",
    ),
]


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class ReasoningConfig(Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None


class TextFormat(Body):
    type: str
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1, le=_MAX_INT64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ()) or self.top_logprobs is not None


LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = frozenset(
    {
        LOGPROBS,
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
    }
)
"""OpenAI's `include` values. Of the outputs they name this server makes only `output_text`'s logprobs: the others
add nothing (Codex, for one, asks for `reasoning.encrypted_content`)."""


def prepare_response(body: ResponsesRequest, model: Model, settings: ServerSettings) -> PreparedRequest:
    if body.previous_response_id is not None or body.conversation is not None:
        field = "previous_response_id" if body.previous_response_id is not None else "conversation"
        raise ApiError(
            400, f"{field}: this server stores no responses; send the whole conversation in input", param=field
        )
    schema = _text_schema(body.text.format if body.text is not None else None)
    tools = _tools(body)
    forced = tools is not None and (body.tool_choice == "required" or isinstance(body.tool_choice, NamedFunction))
    if schema is not None and forced:
        raise ApiError(400, "text.format and a forced tool_choice cannot be combined", param="text.format")
    thinking = _enable_thinking(body.reasoning)
    if (schema is not None or forced) and thinking is None:
        thinking = False  # a constrained reply answers at once unless the client asked it to think first
    for index, value in enumerate(body.include or ()):
        if value not in INCLUDABLE:
            raise ApiError(400, f"include.{index}: {value!r} is not an includable output", param=f"include.{index}")
    options = generation_options(
        settings,
        body.max_output_tokens or settings.default_max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
    )
    if body.wants_logprobs:
        options = dataclasses.replace(options, logprobs=body.top_logprobs or 0)
    messages = _messages(body, ImageReader(model, settings))
    generation = conversation_request(model, messages, options, tools=tools, enable_thinking=thinking, where="input")
    if schema is not None or forced:
        where = "text.format.schema" if schema is not structured.ANY_OBJECT else "text.format"
        generation = structured.constrained(generation, model, schema=schema, where=where, tools=tools)
    return PreparedRequest(generation, body.stream, include_usage=False)


def _text_schema(text_format: TextFormat | None) -> dict[str, Any] | None:
    """The JSON schema `text.format` asks the reply to follow; None for free text."""
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return structured.ANY_OBJECT
    if text_format.type != "json_schema":
        raise ApiError(
            400,
            f"text.format {text_format.type!r} is not supported: use text, json_object or json_schema",
            param="text.format",
        )
    if text_format.schema_ is None:
        raise ApiError(400, "text.format.schema: a JSON schema is required", param="text.format")
    return text_format.schema_


def _enable_thinking(reasoning: ReasoningConfig | None) -> bool | None:
    if reasoning is None or reasoning.effort is None:
        return None
    return reasoning.effort not in ("none", "minimal")


def _tools(body: ResponsesRequest) -> list[Tool] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    tools: list[Tool] = [
        {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)} for tool in body.tools
    ]
    if isinstance(body.tool_choice, NamedFunction):
        name = body.tool_choice.name
        tools = [tool for tool in tools if tool["function"]["name"] == name]
        if not tools:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return tools


def _messages(body: ResponsesRequest, images: ImageReader) -> list[Message]:
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    system = [body.instructions] if body.instructions else []
    messages: list[Message] = []
    reasoning: list[str] = []
    for index, item in enumerate(items):
        where = f"input.{index}"
        if isinstance(item, MessageItem) and item.role == "user":
            messages.append(Message("user", _user_content(item.content, f"{where}.content", images)))
        elif isinstance(item, MessageItem):
            text = _text(item.content, f"{where}.content")
            if item.role in ("system", "developer") and not messages:
                system.append(text)  # the template takes one system message, first
            elif item.role == "assistant":
                turn = _assistant_turn(messages, reasoning)
                turn.content = str(turn.content) + text
            else:
                messages.append(Message("system", text))
        elif isinstance(item, FunctionCallItem):
            call = tool_call(item.name, item.arguments, item.call_id, f"{where}.arguments")
            _assistant_turn(messages, reasoning).tool_calls.append(call)
        elif isinstance(item, FunctionCallOutputItem):
            output = _text(item.output, f"{where}.output")
            messages.append(Message("tool", output, tool_call_id=item.call_id or None))
        else:
            reasoning += [part.text for part in item.content or item.summary]
    if system:
        messages.insert(0, Message("system", "\n\n".join(system)))
    return messages


def _assistant_turn(messages: list[Message], reasoning: list[str]) -> Message:
    """The assistant message that an assistant item belongs to: the last message when it is the assistant's and no
    reasoning item came since, else a new one on `messages` that takes the reasoning read since the last turn."""
    if messages and messages[-1].role == "assistant" and not reasoning:
        return messages[-1]
    messages.append(Message("assistant", "", reasoning_content="".join(reasoning) or None))
    reasoning.clear()
    return messages[-1]


def _user_content(
    content: str | list[MessageContent], where: str, images: ImageReader
) -> str | list[TextPart | ImagePart]:
    """A user message's text and images."""
    if isinstance(content, str) or not any(isinstance(part, ImageContent) for part in content):
        return _text(content, where)
    parts: list[TextPart | ImagePart] = []
    for index, part in enumerate(content):
        if not isinstance(part, ImageContent):
            parts.append(TextPart(_part_text(part, f"{where}.{index}")))
        elif part.image_url is None:
            raise ApiError(
                400,
                f"{where}.{index}: this server keeps no files; send the image as image_url",
                param=f"{where}.{index}",
            )
        else:
            parts.append(images.from_url(part.image_url, f"{where}.{index}"))
    return parts


def _text(content: str | list[MessageContent], where: str) -> str:
    if isinstance(content, str):
        return content
    return "".join(_part_text(part, f"{where}.{index}") for index, part in enumerate(content))


def _part_text(part: MessageContent, where: str) -> str:
    if isinstance(part, ImageContent):
        raise ApiError(400, f"{where}: images are read in user messages only", param=where)
    if isinstance(part, MediaContent):
        raise ApiError(
            400, f"{where}: this server reads text and images only ({part.type} is not supported)", param=where
        )
    return part.text if isinstance(part, TextContent) else part.refusal


class ResponseShape:
    """What the response object says besides its output, the same in every event of a stream."""

    def __init__(
        self, body: ResponsesRequest, model_name: str, count_tokens: Callable[[str], int], shapes: LogprobShapes
    ) -> None:
        self.id = "resp_" + secrets.token_hex(12)
        self.created_at = int(time.time())
        self.model = model_name
        self.count_tokens = count_tokens
        self.shapes = shapes
        self._request = body

    def response(self, status: str, output: list[dict[str, Any]], outcome: Outcome | None = None) -> dict[str, Any]:
        body = self._request
        finished = outcome.finished if outcome is not None else None
        incomplete = finished is not None and finished.reason == "length"
        response: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_logprobs": body.top_logprobs,
            "tool_choice": _dump(body.tool_choice) if body.tool_choice is not None else "auto",
            "tools": [tool.model_dump() for tool in body.tools or []],
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "text": {"format": {"type": "text"}},
            "previous_response_id": None,
            "store": False,
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "usage": None,
        }
        if outcome is not None and finished is not None:
            usage = outcome.usage()
            response["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.count_tokens(finished.reasoning)},
                "total_tokens": usage["total_tokens"],
            }
            response["timings"] = outcome.timings()
        return response

    def final(self, output: list[dict[str, Any]], outcome: Outcome) -> dict[str, Any]:
        assert outcome.finished is not None
        status = "incomplete" if outcome.finished.reason == "length" else "completed"
        return self.response(status, output, outcome)


def _dump(value: object) -> object:
    return value.model_dump() if isinstance(value, Body) else value


def response_body(shape: ResponseShape, outcome: Outcome) -> dict[str, Any]:
    finished = outcome.finished
    assert finished is not None
    output: list[dict[str, Any]] = []
    if finished.reasoning:
        output.append(_reasoning_item(_item_id("rs_"), finished.reasoning, "completed"))
    if finished.content or not finished.tool_calls:
        logprobs = shape.shapes.entries(outcome.content_logprobs)
        output.append(_message_item(_item_id("msg_"), finished.content, "completed", logprobs))
    output += [_function_call_item(_item_id("fc_"), event.call, "completed") for event in finished.tool_calls]
    return shape.final(output, outcome)


def _item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _output_text(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _function_call_item(item_id: str, call: ToolCall, status: str, *, arguments: bool = True) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": _arguments(call) if arguments else "",
        "status": status,
    }


def _arguments(call: ToolCall) -> str:
    return json.dumps(call.arguments, ensure_ascii=False)


class ResponseEventWriter:
    """The typed events of one streamed response (the module docstring lists them)."""

    def __init__(self, shape: ResponseShape, outcome: Outcome) -> None:
        self.shape = shape
        self.outcome = outcome
        self._sequence = 0
        self._blocks = BlockSplitter()
        self._output: list[dict[str, Any]] = []
        """The finished items, in order."""
        self._item_id = ""

    def opening(self) -> list[str]:
        response = self.shape.response("in_progress", [])
        return [
            self._send("response.created", response=response),
            self._send("response.in_progress", response=response),
        ]

    def feed(self, events: Sequence[EngineEvent]) -> list[str]:
        out = [chunk for block in self._blocks.feed(events) for chunk in self._block(block)]
        for event in events:
            self.outcome.absorb(event)
        if self.outcome.done:
            out += [chunk for block in self._blocks.close() for chunk in self._block(block)]
            out += self._closing()
        return out

    def broken(self) -> list[str]:
        return [self._failed("internal server error while streaming; the server log has the details")]

    def _block(self, block: BlockEvent) -> list[str]:
        index = block.index
        if isinstance(block, BlockOpened):
            self._item_id = _item_id({"reasoning": "rs_", "text": "msg_", "tool_call": "fc_"}[block.kind])
            if block.kind == "tool_call":
                assert block.call is not None
                item = _function_call_item(self._item_id, block.call, "in_progress", arguments=False)
                return [self._send("response.output_item.added", output_index=index, item=item)]
            if block.kind == "reasoning":
                item, part = _reasoning_item(self._item_id, None, "in_progress"), {"type": "reasoning_text", "text": ""}
            else:
                item, part = _message_item(self._item_id, None, "in_progress", []), _output_text("", [])
            return [
                self._send("response.output_item.added", output_index=index, item=item),
                self._send("response.content_part.added", **self._at(index), part=part),
            ]
        if isinstance(block, BlockText):
            if block.kind == "reasoning":
                return [self._send("response.reasoning_text.delta", **self._at(index), delta=block.text)]
            logprobs = self.shape.shapes.entries(block.logprobs)
            return [self._send("response.output_text.delta", **self._at(index), delta=block.text, logprobs=logprobs)]
        return self._closed(block)

    def _closed(self, block: BlockClosed) -> list[str]:
        index, item_id = block.index, self._item_id
        if block.kind == "tool_call":
            assert block.call is not None
            arguments = _arguments(block.call)
            item = _function_call_item(item_id, block.call, "completed")
            out = [
                self._send(
                    "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=arguments
                ),
                self._send(
                    "response.function_call_arguments.done", item_id=item_id, output_index=index, arguments=arguments
                ),
            ]
        elif block.kind == "reasoning":
            item = _reasoning_item(item_id, block.text, "completed")
            out = [
                self._send("response.reasoning_text.done", **self._at(index), text=block.text),
                self._send("response.content_part.done", **self._at(index), part=item["content"][0]),
            ]
        else:
            logprobs = self.shape.shapes.entries(block.logprobs)
            item = _message_item(item_id, block.text, "completed", logprobs)
            out = [
                self._send("response.output_text.done", **self._at(index), text=block.text, logprobs=logprobs),
                self._send("response.content_part.done", **self._at(index), part=item["content"][0]),
            ]
        self._output.append(item)
        return [*out, self._send("response.output_item.done", output_index=index, item=item)]

    def _at(self, index: int) -> dict[str, Any]:
        return {"item_id": self._item_id, "output_index": index, "content_index": 0}

    def _closing(self) -> list[str]:
        error = self.outcome.error()
        if error is not None:
            return [self._failed(error[1])]
        response = self.shape.final(self._output, self.outcome)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [self._send(kind, response=response)]

    def _failed(self, message: str) -> str:
        response = self.shape.response("failed", self._output)
        response["error"] = {"code": "server_error", "message": message}  # the one code of OpenAI's that fits
        return self._send("response.failed", response=response)

    def _send(self, kind: str, **data: Any) -> str:
        self._sequence += 1
        return named_sse(kind, {**data, "sequence_number": self._sequence - 1})


def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def responses(request: Request) -> Response:
    runtime = _runtime(request)
    model, _ = runtime.ready()
    body = parse_body(ResponsesRequest, await read_json(request, runtime.settings.max_request_bytes))
    # Rendering and tokenizing a long conversation takes a while: keep it off the event loop.
    prepared = await anyio.to_thread.run_sync(prepare_response, body, model, runtime.settings)
    shape = ResponseShape(
        body, runtime.model_name, lambda text: len(model.tokenize(text)) if text else 0, LogprobShapes(model.tokenizer)
    )
    return await serve(
        request,
        runtime,
        prepared,
        lambda outcome: ResponseEventWriter(shape, outcome),
        lambda outcome: response_body(shape, outcome),
    )


def responses_routes() -> list[Route]:
    return [Route(path, responses, methods=["POST"]) for path in ("/v1/responses", "/responses")]
