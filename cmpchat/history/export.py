"""A chat as a Markdown document, for `export`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cmpchat.history.store import ChatRecord, MessageRecord

_ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool result"}
_STATUS_NOTES = {
    "stopped": "stopped by the user",
    "interrupted": "interrupted: the app ended, or the server's stream broke, while this reply was being written",
    "streaming": "incomplete",
    "error": "generation failed",
}


def chat_to_markdown(
    chat: ChatRecord, messages: Sequence[MessageRecord], image_path: Callable[[str], Path] | None = None
) -> str:
    """The chat as Markdown: a heading per turn, reasoning in a <details> block, images as links."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.created_at))
    lines = [f"# {chat.title}", "", f"_cmpchat chat of {when}" + (f", model {chat.model}_" if chat.model else "_")]
    system_prompt = str(chat.settings.get("system_prompt") or "")
    if system_prompt:
        lines += ["", "## System", "", system_prompt]
    for message in messages:
        lines += ["", f"## {_ROLE_TITLES.get(message.role, message.role)}", ""]
        if message.reasoning:
            seconds = message.stats.get("reasoning_seconds")
            summary = f"Thought for {seconds:.1f} s" if seconds else "Reasoning"
            lines += ["<details>", f"<summary>{summary}</summary>", "", message.reasoning, "", "</details>", ""]
        for image_id in message.images:
            target = image_path(image_id) if image_path else Path(image_id)
            lines.append(f"![image]({target.as_posix()})")
        if message.images:
            lines.append("")
        if message.content:
            lines.append(message.content)
        for call in message.tool_calls:
            arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False, indent=2)
            lines += ["", f"**Tool call** `{call.get('name', '?')}`", "", "```json", arguments, "```"]
        note = _STATUS_NOTES.get(message.status)
        if note:
            lines += ["", f"_({note})_"]
    return "\n".join(lines).rstrip() + "\n"
