"""Chat completions through the official openai client, against a live server over the scripted backend."""

from __future__ import annotations

import json
from typing import cast

import httpx
import openai
from openai.types import CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionAssistantMessageParam,
    ChatCompletionChunk,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

from tests.scripted_backend import ScriptedBackend
from tests.server.live import LiveServer, extra

TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


def user(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


def reply_tokens(server: LiveServer, text: str) -> int:
    """Tokens of a scripted reply: its text, plus the end token."""
    return len(server.served.tokenize(text)) + 1


def last_prompt(server: LiveServer) -> str:
    """The prompt the scripted backend read last, as text."""
    backend = server.served.backend
    assert isinstance(backend, ScriptedBackend)
    return backend.prompts[-1]


def usage(reply: ChatCompletion | ChatCompletionChunk) -> CompletionUsage:
    assert reply.usage is not None
    return reply.usage


def test_plain_chat(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    reply = client.chat.completions.create(model="anything", messages=user("SAY:Hello there"))
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "Hello there"
    assert choice.finish_reason == "stop"
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == "scripted"
    assert usage(reply).completion_tokens == reply_tokens(scripted_server, "Hello there")
    assert usage(reply).total_tokens == usage(reply).prompt_tokens + usage(reply).completion_tokens
    timings = extra(reply)["timings"]
    assert timings["predicted_n"] == usage(reply).completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == usage(reply).prompt_tokens
    assert timings["prompt_per_second"] > 0 and timings["predicted_per_second"] > 0


def test_streamed_chat_follows_the_chunk_contract(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    stream = client.chat.completions.create(
        model="m", messages=user("SAY:Hello there"), stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert "timings" in extra(finals[0])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage(usage_chunk).completion_tokens == reply_tokens(
        scripted_server, "Hello there"
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_ends_with_done(scripted_server: LiveServer) -> None:
    body = {"messages": user("SAY:Hi"), "stream": True}
    with httpx.stream("POST", scripted_server.api + "/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert "usage" not in json.loads(lines[0][6:])  # only with include_usage


def test_thinking_on_gives_reasoning_content(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    reply = client.chat.completions.create(
        model="m",
        messages=user("SAY:Let me think.</think>\n\nThe answer is 4."),
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    message = reply.choices[0].message
    assert extra(message)["reasoning_content"] == "Let me think."
    assert message.content == "The answer is 4."
    assert last_prompt(scripted_server).endswith("<|im_start|>assistant\n<think>\n")


def test_streamed_reasoning_arrives_as_reasoning_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m",
        messages=user("SAY:Hmm.</think>\n\nYes."),
        stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("Hmm.", "Yes.")


def test_no_think_switch_turns_thinking_off(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    reply = client.chat.completions.create(
        model="m",
        messages=user("/no_think SAY:Plain."),
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    prompt = last_prompt(scripted_server)
    assert prompt.endswith("<think>\n\n</think>\n\n") and "/no_think" not in prompt
    assert reply.choices[0].message.content == "Plain."
    assert "reasoning_content" not in extra(reply.choices[0].message)


def test_think_switch_turns_thinking_on(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    client.chat.completions.create(model="m", messages=user("SAY:ok /think"))
    assert last_prompt(scripted_server).endswith("<think>\n")


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "SAY:" + CALL}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="auto")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert call.id.startswith("call_")

    messages += [
        cast(ChatCompletionAssistantMessageParam, choice.message.model_dump(exclude_none=True)),
        {"role": "tool", "tool_call_id": call.id, "content": "SAY:It will be sunny in Paris."},
    ]
    final = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == "It will be sunny in Paris."


def test_streamed_tool_call(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="m", messages=user("SAY:" + CALL), tools=TOOLS, stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function and tc.function.name) for tc in calls] == [(0, "get_weather")]
    function = calls[0].function
    assert function is not None and function.arguments is not None
    assert json.loads(function.arguments) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_hides_the_tools(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    client.chat.completions.create(model="m", messages=user("SAY:ok"), tools=TOOLS, tool_choice="none")
    assert "get_weather" not in last_prompt(scripted_server)
    client.chat.completions.create(
        model="m",
        messages=user("SAY:ok"),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert "get_weather" in last_prompt(scripted_server)


def test_max_tokens_and_stop(client: openai.OpenAI) -> None:
    short = client.chat.completions.create(model="m", messages=user("SAY:abcdefgh"), max_tokens=3)
    assert (short.choices[0].message.content, short.choices[0].finish_reason) == ("abc", "length")
    assert usage(short).completion_tokens == 3
    stopped = client.chat.completions.create(model="m", messages=user("SAY:one, two. three"), stop=[". "])
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == ("one, two", "stop")


def test_sampling_fields_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": "Be brief."}, *user("SAY:fine")],
        temperature=0.9,
        top_p=0.9,
        seed=5,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        max_completion_tokens=50,
        extra_body={"top_k": 40, "min_p": 0.05},
    )
    # The scripted logits have one token far above the rest, so every sampler picks it.
    assert reply.choices[0].message.content == "fine"


def test_developer_role_and_text_parts(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    client.chat.completions.create(
        model="m",
        messages=[
            {"role": "developer", "content": "Rules here."},
            {"role": "user", "content": [{"type": "text", "text": "SAY:"}, {"type": "text", "text": "parts"}]},
        ],
    )
    prompt = last_prompt(scripted_server)
    assert prompt.startswith("<|im_start|>system\nRules here.<|im_end|>") and "SAY:parts" in prompt


def test_a_follow_up_turn_reuses_the_conversation_prefix(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    messages = user("SAY:First answer.")
    first = client.chat.completions.create(model="m", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, *user("SAY:Second.")]
    second = client.chat.completions.create(model="m", messages=messages)
    assert second.choices[0].message.content == "Second."
    details = usage(second).prompt_tokens_details
    assert details is not None
    cached = details.cached_tokens
    # The next turn renders the first answer without the generation prompt's thinking markers: it resumes from
    # the state saved where they begin.
    markers = "<think>\n\n</think>\n\n"
    assert cached == usage(first).prompt_tokens - len(scripted_server.served.tokenize(markers, parse_special=True))
    assert extra(second)["timings"]["cache_n"] == cached


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["scripted"]
    assert extra(models.data[0])["meta"]["context_length"] == 4096


def test_ignore_eos_generates_past_the_end_token(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m", messages=user("SAY:ab"), max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
