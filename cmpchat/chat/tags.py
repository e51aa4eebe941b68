"""The special-token texts that mark reasoning and tool calls in Qwen3.5 prompts and output."""

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
TURN_END = "<|im_end|>"
