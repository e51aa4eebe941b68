"""`cmpchat info`: what a model file holds and the memory it needs."""

from __future__ import annotations

import argparse

from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("info", help="describe a model file and the memory it needs", description=__doc__)
    parser.add_argument("model", metavar="MODEL", help="GGUF model file")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    model_file = ModelFile(args.model)
    config = ModelConfig.from_model_file(model_file)
    print("\n".join(describe(model_file, config)))
    return 0


def describe(model_file: ModelFile, config: ModelConfig) -> list[str]:
    c = config
    size = model_file.path.stat().st_size
    mtp = f" + {c.num_mtp_layers} MTP" if c.num_mtp_layers else ""
    mix = model_file.type_mix()  # most bytes first
    types = f"{len(model_file.tensors)}: " + ", ".join(f"{t.name} x{n} ({_gib(b)})" for t, n, b in mix)
    weights = sum(info.n_bytes for info in model_file.tensors.values())
    from cmpchat.backends.gpu.weights import GPU_TYPES

    missing = ", ".join(t.name for t, _, _ in mix if t not in GPU_TYPES)
    backends = [f"backends      cpu reads every tensor; cuda does not run {missing} yet (GPU support is coming)"]
    kv = c.kv_bytes_per_token()
    template = "from the file" if model_file.get("tokenizer.chat_template") else "none (cmpchat's built-in ChatML)"
    return [
        f"file          {model_file.path} ({_gib(size)})",
        f"model         {c.name} (architecture qwen35)",
        f"layers        {c.num_layers}{mtp}: {len(c.recurrent_layers)} Gated DeltaNet + {len(c.attention_layers)} gated attention",
        f"sizes         hidden {c.hidden_size}, ffn {c.ffn_size}, vocab {c.vocab_size}, context {c.context_length}",
        f"attention     {c.num_heads} heads, {c.num_kv_heads} KV heads, head size {c.head_dim}, "
        f"RoPE on {c.rope_dims} dims (theta {c.rope_theta:g}, sections {list(c.rope_sections)})",
        f"deltanet      {c.num_k_heads} key heads x {c.k_head_dim}, {c.num_v_heads} value heads x {c.v_head_dim}, conv {c.conv_kernel}",
        f"embeddings    {'tied (LM head reuses token_embd)' if c.tied_embeddings else 'separate LM head'}",
        f"tensors       {types}",
        *(backends if missing else []),
        f"chat template {template}",
        "memory        "
        f"weights {_gib(weights)}; KV cache (fp16) {kv / 1024:.0f} KiB per token = {_gib(kv * 32768)} at 32K, "
        f"{_gib(kv * c.context_length)} at {c.context_length}; recurrent state {c.recurrent_state_bytes() / 2**20:.1f} MiB per sequence",
    ]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
