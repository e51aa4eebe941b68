"""Anthropic's Messages API: `POST /v1/messages`, as Claude-Code-style agents and the anthropic client call it, and
`POST /v1/messages/count_tokens`.

Request: `messages` (`role` user or assistant, or system; `content` a string or blocks: `text`; `tool_use` in
assistant turns and `tool_result` in user turns, its content a string or text blocks; `thinking` in assistant
turns, read as that turn's reasoning; `redacted_thinking` is skipped), `system` (a string or text blocks),
`max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k`, `tools` (custom tools: `name`,
`description`, `input_schema`), `tool_choice` (`auto`; `any` and `tool` with a `name`, which offers only that tool,
enforced by a grammar, `server/structured.py`; `none`), `thinking` (`enabled` or `disabled` turn the model's
thinking on or off, `adaptive` leaves the template's default, off for a forced tool; `budget_tokens` is not enforced:
`max_tokens` bounds thinking and answer together). `image` blocks in user turns, with a `base64` source (or a
`url` one, when the server fetches images: `server/images.py`), when the model reads images. Document blocks,
images elsewhere and server tools are refused (400).

Response: a `message` whose `content` holds a `thinking` block (with an empty `signature`: there is nothing to
sign), a `text` block and a `tool_use` block per tool call; `stop_reason` `end_turn`, `max_tokens`, `tool_use` or
`stop_sequence` (with `stop_sequence`, the one that matched); `usage` counts `input_tokens` besides the
`cache_read_input_tokens` resumed from saved states; llama-server's `timings` ride along.

Streamed (`stream: true`): server-sent events named by their type: `message_start`, `ping`, then per block
`content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`, or one `input_json_delta` with a
tool call's whole input) and `content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`;
an `error` event when generation fails. Errors on these routes, streamed or not, take Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`); the API key is read from `x-api-key` as Anthropic sends it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import anyio
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cmpchat.api import Model
from cmpchat.chat.messages import ImagePart, Message, TextPart, Tool, ToolCall
from cmpchat.engine.events import Finished
from cmpchat.engine.request import EngineEvent
from cmpchat.errors import CmpchatError
from cmpchat.server import structured
from cmpchat.server.blocks import BlockClosed, BlockEvent, BlockOpened, BlockSplitter, BlockText
from cmpchat.server.errors import ApiError, anthropic_error_body
from cmpchat.server.generation import serve
from cmpchat.server.guard import read_json
from cmpchat.server.images import ImageReader
from cmpchat.server.prepare import PreparedRequest, conversation_request, generation_options
from cmpchat.server.responses import Outcome, named_sse
from cmpchat.server.runtime import Runtime
from cmpchat.server.schemas import Body, parse_body
from cmpchat.server.settings import ServerSettings

_MAX_INT64 = 2**63 - 1


class TextBlock(Body):
    type: Literal["text"]
    text: str


class ImageSource(Body):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(Body):
    type: Literal["image"]
    source: ImageSource


class MediaBlock(Body):
    type: Literal["document"]


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock | MediaBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]


ContentBlock = Annotated[
    TextBlock | ImageBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class CustomTool(Body):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(Body):
    """The fields that make the prompt (`/v1/messages/count_tokens` takes these alone)."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=_MAX_INT64)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=_MAX_INT64)


def prepare_message(body: MessagesRequest, model: Model, settings: ServerSettings) -> PreparedRequest:
    options = generation_options(
        settings,
        body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=tuple(body.stop_sequences or ()),
        stop_param="stop_sequences",
    )
    tools = _tools(body)
    messages = _messages(body, ImageReader(model, settings))
    generation = conversation_request(model, messages, options, tools=tools, enable_thinking=_enable_thinking(body))
    if _forces_a_tool(body):
        generation = structured.constrained(generation, model, schema=None, where="tools", tools=tools)
    return PreparedRequest(generation, body.stream, include_usage=False)


def count_prompt_tokens(body: CountTokensRequest, model: Model, settings: ServerSettings) -> int:
    """The tokens of the prompt the request's conversation makes (each image's run of pad tokens included)."""
    messages = _messages(body, ImageReader(model, settings))
    try:
        request = model.chat_request(messages, tools=_tools(body), enable_thinking=_enable_thinking(body))
    except CmpchatError as err:
        raise ApiError(400, f"messages: {err}", param="messages") from None
    return len(request.prompt)


def _enable_thinking(body: CountTokensRequest) -> bool | None:
    thinking = body.thinking
    if thinking is None or thinking.type == "adaptive":
        # A forced tool call is made at once unless the client asked the model to think first.
        return False if _forces_a_tool(body) else None
    return thinking.type == "enabled"


def _forces_a_tool(body: CountTokensRequest) -> bool:
    choice = body.tool_choice
    return bool(body.tools) and choice is not None and choice.type in ("any", "tool")


def _tools(body: CountTokensRequest) -> list[Tool] | None:
    choice = body.tool_choice
    if not body.tools or (choice is not None and choice.type == "none"):
        return None
    tools: list[Tool] = [
        {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description or "", "parameters": tool.input_schema},
        }
        for tool in body.tools
    ]
    if choice is not None and choice.type == "tool":
        tools = [tool for tool in tools if tool["function"]["name"] == choice.name]
        if not tools:
            raise ApiError(400, f"tool_choice names {choice.name!r}, which is not among the tools", param="tool_choice")
    return tools


def _messages(body: CountTokensRequest, images: ImageReader) -> list[Message]:
    system = [body.system if isinstance(body.system, str) else "".join(b.text for b in body.system or [])]
    messages: list[Message] = []
    for index, message in enumerate(body.messages):
        where = f"messages.{index}.content"
        if message.role == "system":
            text = _text(message.content, where)
            if messages:
                messages.append(Message("system", text))
            else:
                system.append(text)  # the template takes one system message, first
        elif message.role == "assistant":
            messages.append(_assistant(message.content, where))
        else:
            messages += _user(message.content, where, images)
    system = [text for text in system if text]
    if system:
        messages.insert(0, Message("system", "\n\n".join(system)))
    return messages


def _assistant(content: str | list[ContentBlock], where: str) -> Message:
    if isinstance(content, str):
        return Message("assistant", content)
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for index, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCall(name=block.name, arguments=block.input, id=block.id))
        elif not isinstance(block, RedactedThinkingBlock):
            raise _refused(block, f"{where}.{index}", "in an assistant turn")
    return Message("assistant", "".join(texts), reasoning_content="".join(reasoning) or None, tool_calls=calls)


def _user(content: str | list[ContentBlock], where: str, images: ImageReader) -> list[Message]:
    """A user turn: its tool results, each a tool message, then its text and images, if any."""
    if isinstance(content, str):
        return [Message("user", content)]
    results: list[Message] = []
    parts: list[TextPart | ImagePart] = []
    for index, block in enumerate(content):
        if isinstance(block, TextBlock):
            parts.append(TextPart(block.text))
        elif isinstance(block, ImageBlock):
            parts.append(_image(block.source, f"{where}.{index}", images))
        elif isinstance(block, ToolResultBlock):
            text = _text(block.content, f"{where}.{index}.content")
            results.append(Message("tool", text, tool_call_id=block.tool_use_id))
        else:
            raise _refused(block, f"{where}.{index}", "in a user turn")
    return results + ([Message("user", list(parts))] if parts or not results else [])


def _text(content: str | Sequence[Body], where: str) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for index, block in enumerate(content):
        if not isinstance(block, TextBlock):
            raise _refused(block, f"{where}.{index}", "here")
        texts.append(block.text)
    return "".join(texts)


def _image(source: ImageSource, where: str, images: ImageReader) -> ImagePart:
    if source.type == "base64":
        if source.data is None:
            raise ApiError(400, f"{where}.source.data: a base64 source needs its data", param=f"{where}.source")
        return images.from_base64(source.data, where)
    if source.url is None:
        raise ApiError(400, f"{where}.source.url: a url source needs its url", param=f"{where}.source")
    return images.from_url(source.url, where)


def _refused(block: Body, where: str, place: str) -> ApiError:
    kind = getattr(block, "type", "?")
    if kind == "document":
        return ApiError(
            400, f"{where}: this server reads text and images only (document blocks are not supported)", param=where
        )
    if kind == "image":
        return ApiError(400, f"{where}: image blocks are read in user turns only", param=where)
    return ApiError(400, f"{where}: a {kind} block cannot stand {place}", param=where)


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
"""Anthropic's stop reasons for the engine's finish reasons (a cancelled reply is answered as an error)."""


class MessageShape:
    """What one reply's message says besides its content, the same in the streamed and the whole form."""

    def __init__(self, model_name: str) -> None:
        self.id = "msg_" + secrets.token_hex(12)
        self.model = model_name

    def message(self, content: list[dict[str, Any]], outcome: Outcome) -> dict[str, Any]:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": outcome.prompt_tokens,
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            },
        }
        if outcome.finished is not None:
            message |= self.stop(outcome.finished)
            message["usage"] = self.usage(outcome)
            message["timings"] = outcome.timings()
        return message

    def stop(self, finished: Finished) -> dict[str, Any]:
        stop = finished.stop_sequence
        reason = "stop_sequence" if stop is not None else _STOP_REASONS[finished.reason]
        return {"stop_reason": reason, "stop_sequence": stop}

    def usage(self, outcome: Outcome) -> dict[str, Any]:
        return {
            "input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
            "output_tokens": outcome.usage()["completion_tokens"],
            "cache_read_input_tokens": outcome.cached_tokens,
            "cache_creation_input_tokens": 0,
        }


def message_body(shape: MessageShape, outcome: Outcome) -> dict[str, Any]:
    finished = outcome.finished
    assert finished is not None
    content: list[dict[str, Any]] = []
    if finished.reasoning:
        content.append({"type": "thinking", "thinking": finished.reasoning, "signature": ""})
    if finished.content or not finished.tool_calls:
        content.append({"type": "text", "text": finished.content})
    content += [_tool_use(event.call) for event in finished.tool_calls]
    return shape.message(content, outcome)


def _tool_use(call: ToolCall, *, with_input: bool = True) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments if with_input else {}}


class MessageEventWriter:
    """The named events of one streamed message (the module docstring lists them)."""

    def __init__(self, shape: MessageShape, outcome: Outcome) -> None:
        self.shape = shape
        self.outcome = outcome
        self._blocks = BlockSplitter()

    def opening(self) -> list[str]:
        return [named_sse("message_start", {"message": self.shape.message([], self.outcome)}), named_sse("ping", {})]

    def feed(self, events: Sequence[EngineEvent]) -> list[str]:
        out = [chunk for block in self._blocks.feed(events) for chunk in self._block(block)]
        for event in events:
            self.outcome.absorb(event)
        if self.outcome.done:
            out += [chunk for block in self._blocks.close() for chunk in self._block(block)]
            out += self._closing()
        return out

    def broken(self) -> list[str]:
        return [_error(500, "internal server error while streaming; the server log has the details")]

    def _block(self, block: BlockEvent) -> list[str]:
        index = block.index
        if isinstance(block, BlockOpened):
            if block.kind == "tool_call":
                assert block.call is not None
                started = _tool_use(block.call, with_input=False)
            elif block.kind == "reasoning":
                started = {"type": "thinking", "thinking": "", "signature": ""}
            else:
                started = {"type": "text", "text": ""}
            return [named_sse("content_block_start", {"index": index, "content_block": started})]
        if isinstance(block, BlockText):
            return [named_sse("content_block_delta", {"index": index, "delta": self._delta(block)})]
        return self._closed(block)

    def _delta(self, block: BlockText) -> dict[str, Any]:
        if block.kind == "reasoning":
            return {"type": "thinking_delta", "thinking": block.text}
        return {"type": "text_delta", "text": block.text}

    def _closed(self, block: BlockClosed) -> list[str]:
        out: list[str] = []
        if block.kind == "tool_call":
            assert block.call is not None
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block.call.arguments, ensure_ascii=False)}
            out.append(named_sse("content_block_delta", {"index": block.index, "delta": delta}))
        return [*out, named_sse("content_block_stop", {"index": block.index})]

    def _closing(self) -> list[str]:
        error = self.outcome.error()
        if error is not None:
            return [_error(*error)]
        finished = self.outcome.finished
        assert finished is not None
        delta = {"delta": self.shape.stop(finished), "usage": self.shape.usage(self.outcome)}
        return [named_sse("message_delta", delta), named_sse("message_stop", {})]


def _error(status: int, message: str) -> str:
    return named_sse("error", anthropic_error_body(status, message))


def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def messages(request: Request) -> Response:
    runtime = _runtime(request)
    model, _ = runtime.ready()
    body = parse_body(MessagesRequest, await read_json(request, runtime.settings.max_request_bytes))
    # Rendering and tokenizing a long conversation takes a while: keep it off the event loop.
    prepared = await anyio.to_thread.run_sync(prepare_message, body, model, runtime.settings)
    shape = MessageShape(runtime.model_name)
    return await serve(
        request,
        runtime,
        prepared,
        lambda outcome: MessageEventWriter(shape, outcome),
        lambda outcome: message_body(shape, outcome),
    )


async def count_tokens(request: Request) -> Response:
    runtime = _runtime(request)
    model, _ = runtime.ready()
    body = parse_body(CountTokensRequest, await read_json(request, runtime.settings.max_request_bytes))
    count = await anyio.to_thread.run_sync(count_prompt_tokens, body, model, runtime.settings)
    return JSONResponse({"input_tokens": count})


def messages_routes() -> list[Route]:
    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
