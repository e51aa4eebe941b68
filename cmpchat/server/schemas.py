"""The request bodies the server accepts, as typed models (the OpenAI chat and completions APIs, llama-server's
/tokenize and /detokenize; the Responses and Messages APIs keep theirs in their own modules, on `Body`).

Validation is strict (no "1" for 1, no 1 for true) and unknown fields are ignored, as OpenAI clients
send fields that do not apply here. Fields we know but cannot honour are refused in `prepare`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cmpchat.server.errors import ApiError

_MAX_INT64 = 2**63 - 1

BodyT = TypeVar("BodyT", bound=BaseModel)


class Body(BaseModel):
    """A request body or a part of one: strict types, unknown fields ignored, frozen."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageUrl(Body):
    url: str
    detail: str | None = None


class ImagePart(Body):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(Body):
    name: str
    arguments: str | dict[str, Any] = "{}"
    """JSON text, as OpenAI sends it; an object is accepted too."""


class ToolCallParam(Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(Body):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerationFields(Body):
    """What both endpoints share: the model name, streaming, sampling and limits."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=_MAX_INT64)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=_MAX_INT64)
    """0 or -1: no top-k filter."""
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    stop: str | list[str] | None = Field(None)
    seed: int | None = Field(None, ge=-1, le=_MAX_INT64)
    """-1: a random seed, as llama-server reads it."""
    n: int | None = Field(None, ge=1, le=128)
    ignore_eos: bool = False
    """llama-server's extension: keep generating past end tokens (benchmarks)."""


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_MAX_INT64)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)


class TokenizeRequest(Body):
    """llama-server's /tokenize."""

    content: str
    add_special: bool = False
    """Add the BOS token: Qwen's files have none to add, so this changes nothing."""
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Body):
    """llama-server's /detokenize."""

    tokens: list[int]


def parse_body(model: type[BodyT], data: object) -> BodyT:
    """Validate a decoded JSON body; a failure becomes a 400 naming a bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        # Of a union's failures (one per alternative), the one that got deepest says best what is wrong.
        first = max(err.errors(include_url=False), key=lambda error: len(error["loc"]))
        where = ".".join(str(part) for part in first["loc"] if not _is_type_label(part))
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "none"})


def _is_type_label(part: int | str) -> bool:
    """Whether a part of an error's location names a union's alternative (`str`, `list[...]`, `NamedToolChoice`)
    rather than a field: field names are lower case and plain."""
    return isinstance(part, str) and (part in _TYPE_LABELS or "[" in part or part[:1].isupper())
