"""cmpchat: Qwen3.5 / Qwen3.6 inference and chat for NVIDIA CMP 100-210 mining GPUs."""

__version__ = "0.1.0"
