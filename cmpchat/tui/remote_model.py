"""A model behind an OpenAI-compatible server (`cmpchat --url http://HOST:PORT/v1`), with the calls the app
makes of a local `Model`: `chat` streams the same engine events, so the screens cannot tell them apart.

Speed figures come from the server where it gives them (llama-server's `timings`, which `cmpchat serve`
sends too, then `usage` from `stream_options.include_usage`), else from the client's own clock. Every
failure is one `CmpchatError` line; a stream cut after text came is a `ReplyCut`, so the text is kept.

Images go as data URIs (`image_url` parts), and only to a server that says it reads them: llama-server's
`GET /props` `modalities.vision`, which `cmpchat serve` answers too. To any other server the app sends none.
"""

from __future__ import annotations

import base64
import json
import mimetypes
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from cmpchat.chat.messages import ImagePart, Message, Tool, ToolCall
from cmpchat.chat.tags import THINK_CLOSE, THINK_OPEN
from cmpchat.chat.template import RenderedPrompt
from cmpchat.engine.events import (
    ContentDelta,
    DecodeProgress,
    Finished,
    FinishReason,
    GenerationEvent,
    ReasoningDelta,
    Timings,
    ToolCallEvent,
)
from cmpchat.engine.reply import GenerationOptions
from cmpchat.errors import CmpchatError
from cmpchat.tui.reply_stream import ReplyCut

CONNECT_SECONDS = 10.0
READ_SECONDS = 600.0
"""Longest wait for the next streamed line: a long prompt on a slow card may take minutes to its first token."""
CANCEL_POLL_SECONDS = 0.05
"""How often a reply waiting on the server looks whether it was stopped."""


@dataclass(frozen=True, slots=True)
class RemoteServer:
    """Where the app's replies come from in remote mode: the API's base URL (ending in /v1), its key, and
    the model to ask for (None: the first one the server lists)."""

    url: str
    api_key: str | None = None
    model_name: str | None = None

    @property
    def address(self) -> str:
        """HOST:PORT, for the title bar."""
        return urlsplit(self.url).netloc or self.url

    @property
    def root(self) -> str:
        """The server's address without the API's path: llama-server's own routes live there."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class RemoteModel:
    """One model on a server. `is_demo` and `supports_images` answer what the app asks of every model:
    images are sent, as data URIs, only when the server said it reads them (`reads_images`)."""

    server: RemoteServer
    name: str
    context_length: int = 0
    """Tokens a conversation may hold, when the server lists it (cmpchat: `meta.context_length`); 0 if not."""
    client: httpx.Client = field(repr=False, default_factory=lambda: _client())
    is_demo: bool = False
    supports_images: bool = False

    def chat(
        self,
        messages: Sequence[Message],
        options: GenerationOptions | None = None,
        *,
        tools: Sequence[Tool] | None = None,
        enable_thinking: bool | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationEvent]:
        body = chat_body(self.name, messages, options or GenerationOptions(), enable_thinking)
        return self._stream(body, cancel or threading.Event())

    def render(
        self, messages: Sequence[Message], *, tools: Sequence[Tool] | None = None, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        """The prompt text, from llama-server's /apply-template (cmpchat serve has it; others may not)."""
        # Images are left out: uploading every picture to count the text's tokens is not worth it.
        body: dict[str, Any] = {"messages": [openai_message(m, with_images=False) for m in messages]}
        if enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": enable_thinking}
        prompt = self._post_json(self.server.root + "/apply-template", body)["prompt"]
        return RenderedPrompt(str(prompt), prompt.rstrip().endswith(THINK_OPEN))

    def tokenize(self, text: str, *, parse_special: bool = False) -> list[int]:
        """Token ids, from llama-server's /tokenize."""
        body = {"content": text, "parse_special": parse_special}
        return [int(t) for t in self._post_json(self.server.root + "/tokenize", body)["tokens"]]

    def _post_json(self, url: str, body: dict[str, Any]) -> Any:
        try:
            response = self.client.post(url, json=body, headers=self.server.headers())
        except httpx.HTTPError as err:
            raise CmpchatError(unreachable(self.server, err)) from err
        if response.status_code != 200:
            raise CmpchatError(refusal(response))
        return response.json()

    def _stream(self, body: dict[str, Any], cancel: threading.Event) -> Iterator[GenerationEvent]:
        """The reply's events. The lines are read on a thread of their own, so Esc (or the app ending) stops
        the reply at once, even while the server is silent in a long prompt; that thread closes the
        connection when it next wakes, which tells the server to stop too."""
        lines: queue.Queue[str | Exception | None] = queue.Queue()
        reader = threading.Thread(target=self._read_lines, args=(body, lines, cancel), name="remote-reply", daemon=True)
        reader.start()
        reading = StreamReading(time.perf_counter())
        while True:
            try:
                line = lines.get(timeout=CANCEL_POLL_SECONDS)
            except queue.Empty:
                line = ""
            if cancel.is_set():
                yield from reading.ending("cancelled")
                return
            if line is None:
                break
            if isinstance(line, httpx.HTTPError):
                if reading.has_text:
                    raise ReplyCut(f"the server's stream broke off: {failure_reason(line)}") from line
                raise CmpchatError(unreachable(self.server, line)) from line
            if isinstance(line, Exception):  # the server's refusal, already one line
                raise line
            yield from reading.feed_line(line)
            if reading.done:
                yield from reading.ending(reading.finish_reason)
                return
        if reading.has_text:
            raise ReplyCut("the server ended the stream before the reply was finished")
        raise CmpchatError("the server ended the stream without a reply")

    def _read_lines(
        self, body: dict[str, Any], lines: queue.Queue[str | Exception | None], cancel: threading.Event
    ) -> None:
        """Put each line of the response on `lines`, then None at its end, or the failure."""
        try:
            with self.client.stream(
                "POST", self.server.url + "/chat/completions", json=body, headers=self.server.headers()
            ) as response:
                if response.status_code != 200:
                    response.read()
                    lines.put(CmpchatError(refusal(response)))
                    return
                for line in response.iter_lines():
                    if cancel.is_set():
                        return
                    lines.put(line)
            lines.put(None)
        except httpx.HTTPError as err:
            lines.put(err)


@dataclass(slots=True)
class StreamReading:
    """The state of one streamed reply: text so far, tool calls being assembled, and the figures."""

    started: float
    reasoning: str = ""
    content: str = ""
    finish_reason: FinishReason = "stop"
    done: bool = False
    chunks: int = 0
    """Text chunks received: the client's count of tokens when the server reports none."""
    first_text: float | None = None
    last_text: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    inline_think: InlineThink = field(default_factory=lambda: InlineThink())

    @property
    def has_text(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def feed_line(self, line: str) -> Iterator[GenerationEvent]:
        """Events from one server-sent-event line (`data: {...}`); other lines carry nothing for us."""
        if not line.startswith("data:"):
            return
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as err:
            raise CmpchatError(f"the server sent a line that is not JSON: {data[:80]}") from err
        if "error" in chunk:
            message = error_message(chunk, "the server reported an error")
            raise ReplyCut(message) if self.has_text else CmpchatError(message)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("timings"):
            self.timings = chunk["timings"]
        for choice in chunk.get("choices") or []:
            yield from self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> Iterator[GenerationEvent]:
        delta = choice.get("delta") or {}
        # vLLM and some proxies name it `reasoning`; llama-server and cmpchat `reasoning_content`.
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        events: list[GenerationEvent] = []
        if reasoning:
            events.append(ReasoningDelta(reasoning))
        if delta.get("content"):
            events.extend(self.inline_think.split(delta["content"]))
        for call in delta.get("tool_calls") or []:
            self._add_call_part(call)
        if events or delta.get("tool_calls"):
            now = time.perf_counter()
            self.first_text = self.first_text or now
            self.last_text = now
            self.chunks += 1
        for event in events:
            if isinstance(event, ReasoningDelta):
                self.reasoning += event.text
            elif isinstance(event, ContentDelta):
                self.content += event.text
            yield event
        if events:
            yield DecodeProgress(self.chunks, self._client_rate())
        if choice.get("finish_reason"):
            reason = choice["finish_reason"]
            self.finish_reason = reason if reason in ("stop", "length", "tool_calls") else "stop"

    def _add_call_part(self, part: dict[str, Any]) -> None:
        """Tool calls stream in pieces by index: the id and name first, the arguments' JSON in fragments."""
        call = self.calls.setdefault(int(part.get("index", len(self.calls))), {"id": "", "name": "", "arguments": ""})
        function = part.get("function") or {}
        call["id"] = part.get("id") or call["id"]
        call["name"] += function.get("name") or ""
        call["arguments"] += function.get("arguments") or ""

    def _client_rate(self) -> float:
        if self.first_text is None or self.last_text <= self.first_text:
            return 0.0
        return (self.chunks - 1) / (self.last_text - self.first_text)

    def ending(self, reason: FinishReason) -> Iterator[GenerationEvent]:
        """The last events: text held back while it could have been a tag, the tool calls (as the engine
        sends them, only for a reply that was not stopped), then `Finished`."""
        held = self.inline_think.flush()
        if held:
            self.content += held
            yield ContentDelta(held)
        calls = self.tool_calls() if reason != "cancelled" else ()
        yield from calls
        yield Finished(reason, self.content, self.reasoning, calls, self.figures())

    def tool_calls(self) -> tuple[ToolCallEvent, ...]:
        events = []
        for _, call in sorted(self.calls.items()):
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                arguments = {"arguments": call["arguments"]}  # kept as the server sent it, not lost
            events.append(ToolCallEvent(ToolCall(call["name"], arguments, call["id"])))
        return tuple(events)

    def figures(self) -> Timings:
        """The server's timings, else its usage with the client's clock, else the client's count and clock."""
        first = (self.first_text or time.perf_counter()) - self.started
        t, usage = self.timings, self.usage
        generated = int(t.get("predicted_n") or usage.get("completion_tokens") or self.chunks)
        if t.get("predicted_ms"):
            decode_seconds, steps = float(t["predicted_ms"]) / 1000, generated
        else:
            decode_seconds, steps = (
                max(self.last_text - (self.first_text or self.last_text), 0.0),
                max(generated - 1, 0),
            )
        prompt_tokens = int(t.get("prompt_n") or usage.get("prompt_tokens") or 0)
        prompt_seconds = float(t["prompt_ms"]) / 1000 if t.get("prompt_ms") else first
        first_token = float(t["time_to_first_token_ms"]) / 1000 if t.get("time_to_first_token_ms") else first
        return Timings(prompt_tokens, prompt_seconds, generated, steps, decode_seconds, first_token)


@dataclass(slots=True)
class InlineThink:
    """Reasoning sent inside `content` as `<think>...</think>` (servers that do not split it out). Only a
    reply that opens with `<think>` is split: a `<think>` later in an answer is text, shown as written."""

    state: str = "start"
    """"start" (deciding), "reasoning" (inside the block) or "content" (the rest is answer text)."""
    held: str = ""

    def split(self, text: str) -> list[GenerationEvent]:
        self.held += text
        events: list[GenerationEvent] = []
        if self.state == "start":
            opening = self.held.lstrip()
            if THINK_OPEN.startswith(opening):
                return events  # still could be the tag
            if opening.startswith(THINK_OPEN):
                self.state, self.held = "reasoning", opening[len(THINK_OPEN) :]
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.held.find(THINK_CLOSE)
            if end < 0:
                keep = _partial_suffix(self.held, THINK_CLOSE)
                reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return [ReasoningDelta(reasoning)] if reasoning else events
            if end:
                events.append(ReasoningDelta(self.held[:end]))
            self.state, self.held = "content", self.held[end + len(THINK_CLOSE) :].lstrip()
        if self.state == "content" and self.held:
            events.append(ContentDelta(self.held))
            self.held = ""
        return events

    def flush(self) -> str:
        """Text held at the end (a reply that was only the start of a tag) is answer text."""
        held, self.held = self.held, ""
        return held if self.state != "reasoning" else ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def connect(server: RemoteServer, progress: Callable[[str, int, int], None] | None = None) -> RemoteModel:
    """Ask the server for its models (GET /models) and take the one named, or the first."""
    client = _client()
    if progress is not None:
        progress(f"connecting to {server.address}", 0, 1)
    try:
        response = client.get(server.url + "/models", headers=server.headers())
    except httpx.HTTPError as err:
        client.close()
        raise CmpchatError(unreachable(server, err)) from err
    if response.status_code != 200:
        client.close()
        raise CmpchatError(refusal(response))
    try:
        listed = [entry for entry in response.json().get("data", []) if entry.get("id")]
    except (ValueError, AttributeError) as err:
        client.close()
        raise CmpchatError(f"{server.url}/models did not answer with a model list: is this an OpenAI API?") from err
    entry = next((e for e in listed if server.model_name in (None, e["id"])), None)
    if entry is None:
        client.close()
        if server.model_name is None:
            raise CmpchatError(f"{server.address} serves no model")
        names = ", ".join(e["id"] for e in listed) or "none"
        raise CmpchatError(f"{server.address} does not serve {server.model_name!r} (it serves: {names})")
    meta = entry.get("meta") or {}
    context = meta.get("context_length") or meta.get("n_ctx") or 0
    return RemoteModel(server, str(entry["id"]), int(context), client, supports_images=reads_images(server, client))


def reads_images(server: RemoteServer, client: httpx.Client) -> bool:
    """Whether the server says it reads images: `modalities.vision` of llama-server's `GET /props` (cmpchat
    serve's too). A server without it (vLLM, OpenAI, a proxy) is taken to read none."""
    try:
        response = client.get(server.root + "/props", headers=server.headers(), timeout=CONNECT_SECONDS)
        modalities = response.json().get("modalities") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
    return isinstance(modalities, dict) and modalities.get("vision") is True


def chat_body(
    model: str, messages: Sequence[Message], options: GenerationOptions, enable_thinking: bool | None
) -> dict[str, Any]:
    """The streamed chat request. Fields outside OpenAI's own (top_k, chat_template_kwargs) are sent only
    when they say something, since OpenAI itself refuses fields it does not know."""
    sampling = options.sampling
    body: dict[str, Any] = {
        "model": model,
        "messages": [openai_message(m) for m in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    if options.max_tokens is not None:
        body["max_tokens"] = options.max_tokens
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if enable_thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": enable_thinking}
    return body


def openai_message(message: Message, *, with_images: bool = True) -> dict[str, Any]:
    """The message in OpenAI's form; one with images (and `with_images`) has content parts, each image a
    data URI of its file's bytes."""
    content: str | list[dict[str, Any]] = message.text
    if with_images and message.images and not isinstance(message.content, str):
        content = [
            {"type": "image_url", "image_url": {"url": data_uri(part)}}
            if isinstance(part, ImagePart)
            else {"type": "text", "text": part.text}
            for part in message.content
            if isinstance(part, ImagePart) or part.text
        ]
    body: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        body["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        body["tool_call_id"] = message.tool_call_id
    return body


def data_uri(image: ImagePart) -> str:
    """`data:<type>;base64,...` of the image's bytes (`data`, else the file `ref` names)."""
    data = image.data
    if data is None:
        try:
            data = Path(image.ref).read_bytes()
        except OSError as err:
            raise CmpchatError(f"{Path(image.ref).name} could not be read: {err.strerror or err}") from None
    kind = mimetypes.guess_type(image.ref)[0] or ""
    if not kind.startswith("image/"):
        kind = "image/png"
    return f"data:{kind};base64,{base64.b64encode(data).decode('ascii')}"


def unreachable(server: RemoteServer, err: httpx.HTTPError) -> str:
    return f"cannot reach the server at {server.url}: {failure_reason(err)}"


def refusal(response: httpx.Response) -> str:
    """One line for a refused request: what the server said, and for 401 what to do about it."""
    try:
        said = error_message(response.json(), "")
    except ValueError:
        said = response.text.strip().splitlines()[0][:200] if response.text.strip() else ""
    status = f"the server answered {response.status_code} {response.reason_phrase}".rstrip()
    if response.status_code == 401:
        status += " (give the server's key with --api-key)"
    return f"{status}: {said}" if said else status


def error_message(body: object, fallback: str) -> str:
    """The message of an OpenAI-shaped error body (`{"error": {"message": ...}}`, or a plain string)."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or fallback)
    return str(error) if error else fallback


def failure_reason(err: httpx.HTTPError) -> str:
    """Why a request got no answer, in a few words."""
    if isinstance(err, httpx.ConnectError):
        return f"connection failed ({err})" if str(err) else "connection failed"
    if isinstance(err, httpx.TimeoutException):
        return "no answer in time"
    return str(err) or type(err).__name__


def _client() -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(READ_SECONDS, connect=CONNECT_SECONDS))
