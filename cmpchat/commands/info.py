"""`cmpchat info`: what a model file holds and the memory it needs."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from cmpchat.commands.model_args import add_kv_argument
from cmpchat.errors import CmpchatError
from cmpchat.kv_formats import F16, FORMATS
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile

PLANNED_CARD = "CMP 100-210 (planned)"
"""Where no GPU is usable, `--gpu-mem` plans for cards like the one this is for: sm_70 with 68 SMs."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("info", help="describe a model file and the memory it needs", description=__doc__)
    parser.add_argument("model", metavar="MODEL", help="GGUF model file")
    parser.add_argument("--gpus", metavar="LIST", help="plan a pipeline on these GPUs, e.g. 0,1,2 (repeats allowed)")
    parser.add_argument("--gpu-mem", metavar="SIZE", help="memory per stage, e.g. 16G (without a GPU: plan for "
                        "CMP 100-210 cards of this size)")  # fmt: skip
    parser.add_argument("--split", metavar="LIST", help="layers per stage, e.g. 22,22,20")
    parser.add_argument("--ctx", type=int, metavar="N", help="most tokens of context per conversation")
    parser.add_argument("--slots", type=int, default=1, metavar="N", help="replies decoded together (default 1)")
    add_kv_argument(parser, "(default f16): plan the GPU's KV pool in it")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    model_file = ModelFile(args.model)
    config = ModelConfig.from_model_file(model_file)
    print("\n".join(describe(model_file, config)))
    print("\n".join(gpu_plan(model_file, config, args)))
    return 0


def gpu_plan(model_file: ModelFile, config: ModelConfig, args: argparse.Namespace) -> list[str]:
    """Each stage's memory plan, as loading would print it: on this machine's GPUs, or, without one, on the
    cards `--gpu-mem` describes; a line saying why when the model cannot be planned."""
    from dataclasses import replace

    from cmpchat.backends.gpu.device import SIMULATED_GPU, GpuInfo, cuda_gpu_present, gpu_count, gpu_info
    from cmpchat.backends.gpu.model import choose_stages
    from cmpchat.commands.model_args import gpu_memory, int_list
    from cmpchat.kernels.device_table import SM_70

    gpu_mem, gpus, split = gpu_memory(args.gpu_mem), int_list(args.gpus, "--gpus"), int_list(args.split, "--split")
    options = {"sequences": args.slots + 4, "context": args.ctx, "kv_tokens": None, "gpu_mem": gpu_mem, "split": split,
               "kv": args.kv or F16.name}  # fmt: skip
    lookup: Callable[[int], GpuInfo] = gpu_info
    available: Callable[[], int] = gpu_count
    tuning = None
    if not cuda_gpu_present():
        if gpu_mem is None:
            return ["gpu plan      no GPU here; give --gpu-mem (and --gpus) to plan for cards of that size"]
        sizes = gpu_mem if isinstance(gpu_mem, list) else [gpu_mem]
        largest = max(size or 0 for size in sizes)
        card = replace(SIMULATED_GPU, name=PLANNED_CARD, free_bytes=largest, total_bytes=largest, multiprocessors=68)
        count = len(gpus or split or sizes) if (gpus or split or len(sizes) > 1) else 8

        lookup, available, tuning = (lambda index: replace(card, index=index)), (lambda: count), SM_70
    try:
        infos, plans = choose_stages(
            model_file, config, gpus, tuning, args.ctx, options, lookup=lookup, available=available
        )
    except CmpchatError as error:
        return [f"gpu plan      {error}"]
    lines = [
        f"gpu plan      {len(plans)} stage(s), {args.slots} reply slot(s) and 4 saved states; as loading plans it:"
    ]
    for index, (info, plan) in enumerate(zip(infos, plans, strict=True)):
        lines.append(f"  GPU {info.index} ({info.name}), stage {index}")
        lines += [f"    {line}" for line in plan.describe()]
    stages = [info.index for info in infos]
    pools = []
    for name in FORMATS:  # the same stages with each KV format the GPU takes
        try:
            _, format_plans = choose_stages(model_file, config, stages, tuning, args.ctx, {**options, "kv": name},
                                            lookup=lookup, available=available)  # fmt: skip
        except CmpchatError:
            pools.append(f"{name}: none")
            continue
        pools.append(f"{name}: {min(plan.pool_tokens for plan in format_plans):,}")
    lines.append(f"kv formats    tokens a KV pool holds on these stages (--kv): {', '.join(pools)}")
    return lines


def describe(model_file: ModelFile, config: ModelConfig) -> list[str]:
    c = config
    size = model_file.path.stat().st_size
    mtp = f" + {c.num_mtp_layers} MTP" if c.num_mtp_layers else ""
    mix = model_file.type_mix()  # most bytes first
    types = f"{len(model_file.tensors)}: " + ", ".join(f"{t.name} x{n} ({_gib(b)})" for t, n, b in mix)
    weights = sum(info.n_bytes for info in model_file.tensors.values())
    from cmpchat.backends.gpu.weights import check_gpu_types

    try:
        check_gpu_types(model_file, config)
        backends = []
    except CmpchatError as refusal:
        backends = [f"backends      cpu reads every tensor; cuda refuses the file: {refusal}"]
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
        *backends,
        f"chat template {template}",
        "memory        "
        f"weights {_gib(weights)}; KV cache (fp16) {kv / 1024:.0f} KiB per token = {_gib(kv * 32768)} at 32K, "
        f"{_gib(kv * c.context_length)} at {c.context_length}; recurrent state {c.recurrent_state_bytes() / 2**20:.1f} MiB per sequence",
    ]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
