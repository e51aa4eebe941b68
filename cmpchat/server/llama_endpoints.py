"""llama-server's own endpoints, with its request and response fields, for the tools written against it.

- `POST /tokenize` takes `content` (text), `parse_special` (default true: special-token text becomes its token),
  `with_pieces` (default false) and `add_special` (accepted; Qwen's files have no BOS token to add). It answers
  `{"tokens": [ids]}`, or with pieces `{"tokens": [{"id", "piece"}]}`, where `piece` is the token's text, or
  its byte values when they are not UTF-8 on their own (one byte of a character split over tokens).
- `POST /detokenize` takes `tokens` (ids) and answers `{"content": text}`.
- `POST /apply-template` takes a chat request (`messages`, `tools`, `tool_choice`, `chat_template_kwargs`) and
  answers `{"prompt": text}`: what the model would read, ending with the assistant's turn.
- `GET /props` answers `default_generation_settings` (`n_ctx`: one sequence's context; `params`: what a request
  that sets nothing gets), `total_slots`, `model_alias`, `model_path`, `chat_template`, `modalities`,
  `build_info` and `is_sleeping`; `modalities.vision` says whether requests may hold images.
- `GET /slots` answers one object per slot: `id`, `id_task` (the request's id, -1 when free), `n_ctx`,
  `speculative`, `is_processing`, `params` and `next_token` (`has_next_token`, `has_new_line`, `n_remain`,
  `n_decoded`). With `?fail_on_no_slot=1` it is a 503 when every slot is busy.

`params` has llama-server's names for what cmpchat samples with: `n_predict` and `max_tokens` (the token limit,
-1 for none), `seed` (-1: a random one), `temperature`, `top_k`, `top_p`, `min_p`, `repeat_last_n`,
`repeat_penalty`, `presence_penalty`, `frequency_penalty`, `stop`, `ignore_eos`. `/v1/health` is `/health`; both
answer without the API key, which every other route takes as `Authorization: Bearer <key>` or `X-Api-Key: <key>`.
"""

from __future__ import annotations

from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cmpchat import __version__
from cmpchat.api import Model
from cmpchat.engine.reply import GenerationOptions
from cmpchat.server.errors import ApiError
from cmpchat.server.guard import read_json
from cmpchat.server.prepare import render_chat
from cmpchat.server.runtime import Runtime
from cmpchat.server.schemas import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest, parse_body
from cmpchat.server.slots import SlotHolder


def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def _body(request: Request, runtime: Runtime) -> Any:
    return await read_json(request, runtime.settings.max_request_bytes)


async def tokenize(request: Request) -> Response:
    runtime = _runtime(request)
    model, _ = runtime.ready()
    body = parse_body(TokenizeRequest, await _body(request, runtime))
    # A long text takes a while: keep it off the event loop.
    return JSONResponse({"tokens": await anyio.to_thread.run_sync(_tokens, body, model)})


def _tokens(body: TokenizeRequest, model: Model) -> list[int] | list[dict[str, Any]]:
    ids = model.tokenize(body.content, parse_special=body.parse_special)
    if not body.with_pieces:
        return ids
    return [{"id": token, "piece": _piece(model, token)} for token in ids]


def _piece(model: Model, token: int) -> str | list[int]:
    raw = model.tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def detokenize(request: Request) -> Response:
    runtime = _runtime(request)
    model, _ = runtime.ready()
    body = parse_body(DetokenizeRequest, await _body(request, runtime))
    vocab = model.tokenizer.vocab_size
    if any(not 0 <= token < vocab for token in body.tokens):
        raise ApiError(400, f"tokens: token ids must be in 0..{vocab - 1}", param="tokens")
    return JSONResponse({"content": model.detokenize(body.tokens)})


async def apply_template(request: Request) -> Response:
    runtime = _runtime(request)
    model, _ = runtime.ready()
    body = parse_body(ChatCompletionRequest, await _body(request, runtime))
    prompt = await anyio.to_thread.run_sync(render_chat, body, model, runtime.settings)
    return JSONResponse({"prompt": prompt})


async def props(request: Request) -> Response:
    runtime = _runtime(request)
    model, _ = runtime.ready()
    return JSONResponse(
        {
            "default_generation_settings": {
                "n_ctx": model.backend.context_limit,
                "params": _params(_default_options(runtime)),
            },
            "total_slots": runtime.settings.slots,
            "model_alias": runtime.model_name,
            "model_path": str(model.path),
            "chat_template": model.chat_format.source,
            "modalities": {"vision": model.supports_images, "audio": False},
            "build_info": f"cmpchat {__version__}",
            "is_sleeping": False,
        }
    )


async def slots(request: Request) -> Response:
    runtime = _runtime(request)
    model, _ = runtime.ready()
    holders = runtime.slots.holders()
    if request.query_params.get("fail_on_no_slot") == "1" and None not in holders:
        raise ApiError(503, "no slot available", code="no_slot_available")
    n_ctx = model.backend.context_limit
    defaults = _default_options(runtime)
    return JSONResponse([_slot(index, holder, n_ctx, defaults) for index, holder in enumerate(holders)])


def _slot(index: int, holder: SlotHolder | None, n_ctx: int, defaults: GenerationOptions) -> dict[str, Any]:
    options = defaults if holder is None else holder.options
    generated = 0 if holder is None else holder.generated
    limit = options.max_tokens
    return {
        "id": index,
        "id_task": -1 if holder is None else holder.task,
        "n_ctx": n_ctx,
        "speculative": False,
        "is_processing": holder is not None,
        "params": _params(options),
        "next_token": {
            "has_next_token": holder is not None,
            "has_new_line": holder is not None and holder.new_line,
            "n_remain": -1 if limit is None else limit - generated,
            "n_decoded": generated,
        },
    }


def _default_options(runtime: Runtime) -> GenerationOptions:
    settings = runtime.settings
    return GenerationOptions(sampling=settings.sampling, max_tokens=settings.default_max_tokens)


def _params(options: GenerationOptions) -> dict[str, Any]:
    sampling = options.sampling
    limit = -1 if options.max_tokens is None else options.max_tokens
    return {
        "n_predict": limit,
        "max_tokens": limit,
        "seed": -1 if sampling.seed is None else sampling.seed,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "repeat_last_n": sampling.penalty_window,
        "repeat_penalty": sampling.repetition_penalty,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "stop": list(options.stop),
        "ignore_eos": options.ignore_eos,
    }


def llama_routes() -> list[Route]:
    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/apply-template", apply_template, methods=["POST"]),
        Route("/props", props, methods=["GET"]),
        Route("/slots", slots, methods=["GET"]),
    ]
