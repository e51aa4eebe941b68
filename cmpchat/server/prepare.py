"""From a validated request body to what the engine runs: messages, prompt tokens, options, tools.

Everything a client can get wrong ends here as a 400 with a message that names the field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from cmpchat.api import Model
from cmpchat.chat.messages import ImagePart as ChatImagePart
from cmpchat.chat.messages import Message, TextPart, Tool, ToolCall
from cmpchat.chat.output_parser import new_call_id
from cmpchat.engine.reply import GenerationOptions
from cmpchat.engine.request import GenerationRequest
from cmpchat.errors import CmpchatError
from cmpchat.sampling import SamplingParams
from cmpchat.server import structured
from cmpchat.server.errors import ApiError
from cmpchat.server.images import ImageReader
from cmpchat.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationFields,
    ImagePart,
    NamedToolChoice,
)
from cmpchat.server.settings import ServerSettings

MAX_STOP_STRINGS = 16

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    generation: GenerationRequest
    stream: bool
    include_usage: bool

    @property
    def prompt_tokens(self) -> int:
        return len(self.generation.prompt)


def prepare_chat(body: ChatCompletionRequest, model: Model, settings: ServerSettings) -> PreparedRequest:
    _refuse_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    images = ImageReader(model, settings)
    messages = [_message(m, i, images) for i, m in enumerate(body.messages)]
    limit = body.max_completion_tokens or body.max_tokens or settings.default_max_tokens
    tools = _tools(body)
    schema = _response_schema(body)
    forced = tools is not None and (body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice))
    if schema is not None and forced:
        raise ApiError(400, "response_format and a forced tool_choice cannot be combined", param="response_format")
    constrained = schema is not None or forced
    if constrained and body.ignore_eos:
        raise ApiError(400, "ignore_eos cannot be combined with structured output", param="ignore_eos")
    thinking = _enable_thinking(body.chat_template_kwargs)
    if constrained and thinking is None:
        thinking = False  # a constrained reply answers at once unless the client asked it to think first
    options = _options(body, settings, limit)
    if body.logprobs:
        options = dataclasses.replace(options, logprobs=body.top_logprobs or 0)
    generation = conversation_request(model, messages, options, tools=tools, enable_thinking=thinking)
    if constrained:
        named = body.response_format is not None and body.response_format.type == "json_schema"
        where = "response_format.json_schema.schema" if named else "response_format"
        generation = structured.constrained(generation, model, schema=schema, where=where, tools=tools)
    return PreparedRequest(generation, body.stream, _include_usage(body))


def _response_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema the reply must follow; None for free text."""
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return structured.ANY_OBJECT
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise ApiError(400, "response_format.json_schema.schema: a JSON schema is required", param="response_format")
    return response_format.json_schema.schema_


def conversation_request(
    model: Model,
    messages: Sequence[Message],
    options: GenerationOptions,
    *,
    tools: list[Tool] | None,
    enable_thinking: bool | None,
    where: str = "messages",
) -> GenerationRequest:
    """The engine request for the assistant's next turn of a conversation, every API's; a conversation the
    template refuses, or one too long for the context, is a 400 (`where` names the field it came from)."""
    try:
        generation = model.chat_request(messages, options, tools=tools, enable_thinking=enable_thinking)
    except CmpchatError as err:
        raise ApiError(400, f"{where}: {err}", param=where) from None
    check_context(generation.prompt, model)
    return generation


def render_chat(body: ChatCompletionRequest, model: Model, settings: ServerSettings) -> str:
    """The prompt text a chat request's conversation makes, as the model reads it (for /apply-template)."""
    images = ImageReader(model, settings)
    messages = [_message(m, i, images) for i, m in enumerate(body.messages)]
    try:
        prompt = model.render(messages, tools=_tools(body), enable_thinking=_enable_thinking(body.chat_template_kwargs))
    except CmpchatError as err:
        raise ApiError(400, f"messages: {err}", param="messages") from None
    return prompt.text


def prepare_completion(body: CompletionRequest, model: Model, settings: ServerSettings) -> PreparedRequest:
    _refuse_unsupported(body)
    if body.echo:
        raise ApiError(400, "echo is not supported by this server", param="echo")
    if body.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported by this server", param="suffix")
    if body.best_of is not None and body.best_of > 1:
        raise ApiError(400, "best_of > 1 is not supported by this server", param="best_of")
    tokens = _completion_prompt(body.prompt, model)
    check_context(tokens, model)
    limit = body.max_tokens or settings.default_completion_max_tokens
    # Completions return text as is; `logprobs` is the count of most likely tokens to report (0: the chosen one).
    options = dataclasses.replace(_options(body, settings, limit), raw_text=True, logprobs=body.logprobs)
    generation = GenerationRequest(tuple(tokens), options)
    return PreparedRequest(generation, body.stream, _include_usage(body))


def _refuse_unsupported(body: GenerationFields) -> None:
    if body.n is not None and body.n > 1:
        raise ApiError(400, "n > 1 is not supported: this server returns one choice per request", param="n")


def _include_usage(body: GenerationFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _options(body: GenerationFields, settings: ServerSettings, max_tokens: int) -> GenerationOptions:
    return generation_options(
        settings,
        max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        ignore_eos=body.ignore_eos,
    )


def generation_options(
    settings: ServerSettings,
    max_tokens: int,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    stop: tuple[str, ...] = (),
    stop_param: str = "stop",
    ignore_eos: bool = False,
) -> GenerationOptions:
    """Sampling and limits from a request's fields, the server's defaults for those it leaves out (None)."""
    defaults = settings.sampling
    try:
        sampling = SamplingParams(
            temperature=_pick(temperature, defaults.temperature),
            top_k=defaults.top_k if top_k is None else max(top_k, 0),
            top_p=_pick(top_p, defaults.top_p),
            min_p=_pick(min_p, defaults.min_p),
            repetition_penalty=_pick(repetition_penalty, defaults.repetition_penalty),
            presence_penalty=_pick(presence_penalty, defaults.presence_penalty),
            frequency_penalty=_pick(frequency_penalty, defaults.frequency_penalty),
            penalty_window=defaults.penalty_window,
            seed=None if seed is None or seed == -1 else seed,
        )
    except ValueError as err:
        raise ApiError(400, str(err)) from None
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"{stop_param}: at most {MAX_STOP_STRINGS} stop strings", param=stop_param)
    return GenerationOptions(sampling=sampling, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos)


def _pick(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _message(message: ChatMessage, index: int, images: ImageReader) -> Message:
    where = f"messages.{index}"
    role = "system" if message.role == "developer" else message.role
    if message.tool_calls and role != "assistant":
        raise ApiError(400, f"{where}.tool_calls: only assistant messages carry tool calls", param=where)
    calls = [
        tool_call(call.function.name, call.function.arguments, call.id, f"{where}.tool_calls.{j}.function.arguments")
        for j, call in enumerate(message.tool_calls or [])
    ]
    return Message(
        role,
        _content(message, where, images),
        reasoning_content=message.reasoning_content,
        tool_calls=calls,
        tool_call_id=message.tool_call_id,
        name=message.name,
    )


def _content(message: ChatMessage, where: str, images: ImageReader) -> str | list[TextPart | ChatImagePart]:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return [
        images.from_url(part.image_url.url, f"{where}.content.{j}")
        if isinstance(part, ImagePart)
        else TextPart(part.text)
        for j, part in enumerate(message.content)
    ]


def tool_call(name: str, arguments: str | dict[str, Any], call_id: str, where: str) -> ToolCall:
    """A call the assistant made earlier in the conversation; `arguments` is JSON text or an object, and
    `where` names the field that holds them."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ApiError(400, f"{where}: not valid JSON", param=where) from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}: must be a JSON object", param=where)
    return ToolCall(name=name, arguments=arguments, id=call_id or new_call_id())


def _tools(body: ChatCompletionRequest) -> list[Tool] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    # "required" and a named choice are enforced by a grammar (`prepare_chat`); a named choice offers only
    # that tool.
    if isinstance(body.tool_choice, NamedToolChoice):
        name = body.tool_choice.function.name
        tools = [tool for tool in tools if tool["function"]["name"] == name]
        if not tools:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return tools


def _enable_thinking(kwargs: dict[str, Any] | None) -> bool | None:
    value = (kwargs or {}).get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false", param="chat_template_kwargs")
    return value


def _completion_prompt(prompt: str | list[int] | list[str] | list[list[int]], model: Model) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return model.tokenize(prompt, parse_special=True)
    ids = [token for token in prompt if isinstance(token, int)]
    vocab = model.config.vocab_size
    if len(ids) != len(prompt) or any(not 0 <= token < vocab for token in ids):
        raise ApiError(400, f"prompt: token ids must be in 0..{vocab - 1}", param="prompt")
    return ids


def check_context(tokens: Sequence[int], model: Model) -> None:
    if not tokens:
        raise ApiError(400, "the prompt is empty", param="prompt")
    context = model.backend.context_limit
    if len(tokens) >= context:
        raise ApiError(
            400,
            f"the prompt is {len(tokens)} tokens but the model's context holds {context}; shorten it",
            code="context_length_exceeded",
        )
