#!/usr/bin/env python3
"""Train the small Qwen3.5 with transformers' own implementation, within a wall-clock budget.

Reads the token shard and tokenizer that corpus.py wrote (--data), trains a Qwen3_5ForCausalLM of the
shape in MODEL (the released layer pattern and head sizes, narrow and shallow), and writes to --out:

    model-0000N.safetensors   fp32 weights, at most 16 MiB a file (what the device tool brings back)
    optim-0000N.safetensors   AdamW moments in bf16 (for --resume), the trainer state in the metadata
    config.json               the transformers config
    train_log.jsonl           one line per logged step (losses, retrieval hit rates, tokens/s)
    summary.json              figures for the model card: sizes, kernels, steps, tokens, losses, needle grid

At most 7 files, all rewritten every --save-every-s seconds, so a run killed at its time limit still
leaves a usable checkpoint (the device tool returns at most 8 files of 16 MiB).

Kernels. transformers picks flash-linear-attention's Gated DeltaNet kernels when the `fla` package
imports (fla-core carried as a wheel), and the torch reference loops otherwise. This script decides
itself: each fast kernel (fla's chunk_gated_delta_rule, fla's Triton causal conv) is checked forward
and backward against transformers' torch function on the GPU before training; one that fails or does
not import is replaced by the torch path, and the log says which ran (--gdn/--conv force a choice).
fla 0.6.0 refuses the gated backward on Hopper with Triton < 3.7.1 (wrong dg on wgmma, fla #640);
there the script sets DISABLE_MMA_V3=1 (Triton then uses the Ampere-style MMA) and lifts that guard,
and the check decides whether the result is right.

Data: a curriculum over the elapsed fraction of the schedule (PHASES): short sequences (512-2K) first,
three quarters of them pass-key or key -> value retrieval tasks, then 2K-8K, then 8K-64K. Fillers are
corpus text (trained on as text); some are the pass-key task's own repeated sentences or a repeated
corpus snippet, which only serve as context (no loss on them, so they cannot leak into prose). The
answer tokens form their own loss term: loss = mean text CE + ANSWER_LAMBDA * mean answer CE.

After training: held-out loss, then the pass-key grid (the task's own filler, as `cmpchat eval
--needle`; teacher-forced: a trial passes when the argmax gives the space and the 5 digits and then no
further digit), cell by cell until --deadline-s (the grid stops, never the training).

Smoke test on a CPU: see training/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import lzma
import math
import os
import queue
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

T0 = time.time()
HERE = Path(__file__).resolve().parent
REPO = HERE.parent

MODEL = dict(  # the released models' layer pattern and head sizes, narrow and shallow
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=8,
    full_attention_interval=4,  # layers 3 and 7 are gated attention
    num_attention_heads=2,  # two query heads on one KV head (GQA 2:1)
    num_key_value_heads=1,
    head_dim=256,
    partial_rotary_factor=0.25,  # 64 rotary dims
    mrope_section=[11, 11, 10],
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # Hv != Hk: the GGUF's value-head re-tiling is exercised
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    tie_word_embeddings=True,
)
TINY = dict(
    MODEL,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    head_dim=64,
    mrope_section=[3, 3, 2],
)
CONTEXT = 262144
SEED = 26
ANSWER_LAMBDA = 1.0  # the answer tokens' mean CE weighs as much as all text tokens' mean CE
CHAT_FRACTION = 0.12  # of the text-only rows
NEEDLE_DEPTHS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
MAX_FILE_BYTES = 16_600_000  # tensor bytes a safetensors file; with its header under 16 MiB


@dataclass(frozen=True)
class Phase:
    end: float  # the fraction of the schedule where the phase ends
    lengths: tuple[int, ...]
    weights: tuple[float, ...]
    retrieval: float  # share of the rows that carry a retrieval task
    tokens_per_step: int


PHASES = (
    Phase(0.30, (512, 1024, 2048), (0.3, 0.4, 0.3), 0.75, 65536),
    Phase(0.60, (2048, 4096, 8192), (0.3, 0.4, 0.3), 0.75, 65536),
    Phase(1.00, (2048, 8192, 16384, 32768, 65536), (0.1, 0.3, 0.25, 0.25, 0.1), 0.85, 131072),
)

# Retrieval tasks. "passkey" is cmpchat/evaluation/passkey.py's prompt exactly (what the grid tests);
# "records" are key -> value records in varied formats, several a row, one to three asked at the end.
TASKS = ("passkey/corpus", "passkey/own", "passkey/snippet", "records/corpus", "records/snippet")
PASSKEY_FILLERS = (("corpus", 0.7), ("own", 0.2), ("snippet", 0.1))
RECORD_FILLERS = (("corpus", 0.85), ("snippet", 0.15))
PASSKEY_SHARE = 0.5  # of the retrieval rows
# (needle, question, answer); {name} and {value} are filled in; each piece is tokenised on its own and
# the pieces meet at pre-tokenizer boundaries (checked at start-up against whole-string encoding).
RECORD_FORMATS = (
    (
        "\nThe secret number of{name} is{value}.\n",
        "\nWhat is the secret number of{name}? The secret number of{name} is",
        "{value}.",
    ),
    (
        "\nRemember this: the code for{name} is{value}. Keep it in mind.\n",
        "\nWhat is the code for{name}? The code for{name} is",
        "{value}.",
    ),
    ("\n{name} ={value}\n", "\nWhat is the value of{name}? The value of{name} is", "{value}."),
    ("\nNote that the ID of{name} is{value}.\n", "\nWhich ID does{name} have? The ID of{name} is", "{value}."),
    (
        "\nThe locker of{name} opens with the combination{value}.\n",
        "\nWhat opens the locker of{name}? The combination is",
        "{value}.",
    ),
)
RECORD_INTROS = (
    "",
    "Some records are hidden in the text below. Remember them; you will be asked about them.\n",
    "Read the following text carefully.\n",
)
ADJECTIVES = (
    "amber blue brave calm crimson dusty eager fancy gentle golden green hollow icy jolly keen lively "
    "lucky misty noble olive proud quiet rapid rusty silver sleepy swift tidy violet wild witty young"
).split()
NOUNS = (
    "badger beacon cedar comet falcon garden harbor heron island juniper kettle lantern maple meadow "
    "otter pebble quarry raven river saddle spruce thistle tiger tulip valley walrus willow wren yak zephyr"
).split()


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def load_passkey():
    """cmpchat's pass-key format, loaded by path (importing the cmpchat package would need its deps)."""
    spec = importlib.util.spec_from_file_location("passkey", REPO / "cmpchat" / "evaluation" / "passkey.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_shard(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    with lzma.open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        arrays = {}
        for name, size in header["arrays"]:
            arrays[name] = np.frombuffer(f.read(2 * size), dtype="<u2").astype(np.int32)
    return header, arrays


def make_config(spec: dict, vocab: int, eos: int):
    sys.path.insert(0, str(REPO / "tests" / "fixtures" / "oracle"))
    import make_oracle

    cfg = make_oracle.make_config(spec)
    cfg.vocab_size = vocab
    cfg.max_position_embeddings = CONTEXT
    cfg.eos_token_id = eos
    cfg.use_cache = False
    return cfg


def phase_at(progress: float, phases=PHASES) -> int:
    for i, p in enumerate(phases):
        if progress < p.end:
            return i
    return len(phases) - 1


def scaled_phases(scale: float) -> tuple[Phase, ...]:
    """PHASES with every length and batch divided by `scale` (small CPU smoke tests)."""
    if scale == 1:
        return PHASES
    return tuple(
        Phase(
            p.end,
            tuple(max(128, int(n / scale)) for n in p.lengths),
            p.weights,
            p.retrieval,
            max(256, int(p.tokens_per_step / scale)),
        )
        for p in PHASES
    )


class Row:
    """One sequence: ids, per-token text-loss weights, answer group per token (0: none)."""

    __slots__ = ("ids", "w", "ans", "groups")

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.w: list[np.ndarray] = []
        self.ans: list[np.ndarray] = []
        self.groups: list[int] = []  # task index of each answer group in this row

    def add(self, ids, w: float | np.ndarray = 0.0, answer_task: int | None = None) -> None:
        ids = np.asarray(ids, np.int32)
        self.ids.append(ids)
        self.w.append(np.broadcast_to(np.asarray(w, np.float32), ids.shape))
        if answer_task is None:
            self.ans.append(np.zeros(ids.shape, np.int32))
        else:
            self.groups.append(answer_task)
            self.ans.append(np.full(ids.shape, len(self.groups), np.int32))

    def arrays(self):
        return np.concatenate(self.ids), np.concatenate(self.w), np.concatenate(self.ans)


class Batches:
    """Seeded rows of corpus text, chat samples and retrieval tasks (see the module docstring)."""

    def __init__(self, arrays: dict[str, np.ndarray], encode, passkey, seed) -> None:
        self.train, self.chat = arrays["train"], arrays["chat"]
        self.encode, self.pk = encode, passkey
        self.rng = random.Random(seed)
        self._cache: dict[str, list[int]] = {}
        self.space = self.enc(" ")
        self.digit = [self.enc(str(d)) for d in range(10)]
        if len(self.space) != 1 or any(len(d) != 1 for d in self.digit):
            raise SystemExit("the tokenizer does not give one token for ' ' and for each digit")
        self.digit = [d[0] for d in self.digit]
        self.own_filler = self.enc(passkey.FILLER)
        self.intro, self.question = self.enc(passkey.INTRO), self.enc(passkey.QUESTION)
        self.names = [f" {a} {n}" for a in ADJECTIVES for n in NOUNS]
        self.last_passkey: dict = {}  # the last pass-key row's parameters (for the smoke test)
        self.check_pieces()

    def enc(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self._cache[text] = self.encode(text)
        return ids

    def value(self, digits: str) -> list[int]:
        """' ' + digits, as the tokenizer splits them (one token a digit)."""
        return self.space + [self.digit[int(c)] for c in digits]

    def fill(self, template: str, name: str | None = None, value: str | None = None) -> list[int]:
        """Tokens of `template` with {name}/{value} filled, from separately tokenised (cached) pieces."""
        out: list[int] = []
        rest = template
        while rest:
            i = min((rest.find(s) for s in ("{name}", "{value}") if s in rest), default=-1)
            if i < 0:
                out += self.enc(rest)
                break
            if i:
                out += self.enc(rest[:i])
            if rest.startswith("{name}", i):
                out += self.enc(name)
                rest = rest[i + 6 :]
            else:
                out += self.value(value)
                rest = rest[i + 7 :]
        return out

    def passkey_needle(self, key: str) -> tuple[list[int], list[float]]:
        """passkey.NEEDLE with `key`, and text weights: 1 on the second mention's digits (a copy)."""
        head, mid, tail = self.pk.NEEDLE.split("{key}")
        ids = (
            self.enc(head.rstrip(" ")) + self.value(key) + self.enc(mid.rstrip(" ")) + self.value(key) + self.enc(tail)
        )
        w = [0.0] * len(ids)
        second = len(self.enc(head.rstrip(" "))) + 1 + len(key) + len(self.enc(mid.rstrip(" "))) + 1
        for j in range(second, second + len(key)):
            w[j] = 1.0
        return ids, w

    def check_pieces(self, trials: int = 300) -> None:
        """The piecewise tokenisation equals the tokenizer's on whole strings (fails fast otherwise)."""
        rng = random.Random(0)
        for t in range(trials):
            key = self.pk.make_key(rng)
            ids, _ = self.passkey_needle(key)
            if ids != self.encode(self.pk.NEEDLE.format(key=key)):
                raise SystemExit(f"piecewise pass-key needle differs from the tokenizer's for key {key}")
            if self.value(key) + self.enc(".") != self.pk.answer_ids(self.encode, key):
                raise SystemExit("piecewise pass-key answer differs from the tokenizer's")
            fmt = RECORD_FORMATS[t % len(RECORD_FORMATS)]
            name, value = rng.choice(self.names), str(rng.randrange(10**6))
            for template in fmt:
                whole = template.replace("{name}", name).replace("{value}", " " + value)
                if self.fill(template, name, value) != self.encode(whole):
                    raise SystemExit(f"piecewise tokenisation differs for {whole!r}")

    # -- pieces of rows ------------------------------------------------------------------------------
    def text(self, n: int, source: np.ndarray | None = None) -> np.ndarray:
        src = source if source is not None else self.train
        start = self.rng.randrange(0, len(src) - n - 1)
        return src[start : start + n]

    def filler(self, kind: str, n: int) -> tuple[np.ndarray, float, list[int] | None]:
        """(tokens, text weight, repeated unit): corpus text is trained on; repeated fillers (the
        task's own sentences or a corpus snippet) are context only."""
        if kind == "corpus":
            return self.text(n), 1.0, None
        unit = self.own_filler if kind == "own" else self.text(self.rng.randrange(8, 48)).tolist()
        reps = -(-n // len(unit))
        return np.asarray((unit * reps)[:n], np.int32), 0.0, unit

    def choose(self, options) -> str:
        r, acc = self.rng.random(), 0.0
        for name, p in options:
            acc += p
            if r < acc:
                return name
        return options[-1][0]

    # -- rows -------------------------------------------------------------------------------------
    def text_row(self, length: int) -> Row:
        row = Row()
        use_chat = self.rng.random() < CHAT_FRACTION and len(self.chat) > length + 2
        row.add(self.text(length, self.chat if use_chat else None), 1.0)
        return row

    def passkey_row(self, length: int) -> Row:
        """Exactly passkey.build_prompt(encode, length - 7, depth, key, filler) + the 7 answer tokens."""
        kind = self.choose(PASSKEY_FILLERS)
        key = self.pk.make_key(self.rng)
        needle, needle_w = self.passkey_needle(key)
        answer = self.value(key) + self.enc(".")
        room = length - len(answer) - len(self.intro) - len(needle) - len(self.question)
        if room < 1:
            return self.text_row(length)
        body, w, unit = self.filler(kind, room)
        depth = self.rng.random()
        cut = round(depth * room)
        self.last_passkey = {
            "key": key,
            "depth": depth,
            "filler": body.tolist() if unit is None else unit,
            "kind": kind,
        }
        row = Row()
        row.add(self.intro)
        row.add(body[:cut], w)
        row.add(needle, np.asarray(needle_w, np.float32))
        row.add(body[cut:], w)
        row.add(self.question)
        row.add(answer, 0.0, TASKS.index(f"passkey/{kind}"))
        return row

    def records_row(self, length: int) -> Row:
        kind = self.choose(RECORD_FILLERS)
        fmt = self.rng.choice(RECORD_FORMATS)
        most = max(1, min(8, length // 160))
        n = self.rng.randint(1, most)
        names = self.rng.sample(self.names, n)
        values: list[str] = []
        while len(values) < n:
            d = self.rng.randint(3, 8)
            v = str(self.rng.randrange(10 ** (d - 1), 10**d))
            if v not in values:
                values.append(v)
        asked = self.rng.sample(range(n), self.rng.randint(1, min(3, n)))
        intro = self.enc(self.rng.choice(RECORD_INTROS))
        needles = [self.fill(fmt[0], names[i], values[i]) for i in range(n)]
        tail = [(self.fill(fmt[1], names[i], values[i]), self.fill(fmt[2], names[i], values[i])) for i in asked]
        room = length - len(intro) - sum(map(len, needles)) - sum(len(q) + len(a) for q, a in tail)
        if room < 8:
            return self.passkey_row(length)
        body, w, _ = self.filler(kind, room)
        cuts = sorted(self.rng.randrange(room + 1) for _ in range(n))
        order = list(range(n))
        self.rng.shuffle(order)
        row = Row()
        row.add(intro)
        prev = 0
        for cut, i in zip(cuts, order):
            row.add(body[prev:cut], w)
            row.add(needles[i])
            prev = cut
        row.add(body[prev:], w)
        task = TASKS.index(f"records/{kind}")
        for q, a in tail:
            row.add(q)
            row.add(a, 0.0, task)
        return row

    def row(self, length: int, retrieval: float) -> Row:
        if self.rng.random() >= retrieval:
            return self.text_row(length)
        return self.passkey_row(length) if self.rng.random() < PASSKEY_SHARE else self.records_row(length)

    def batch(self, rows: int, length: int, retrieval: float):
        """ids [B, L] int32; text weight [B, L] and answer group [B, L] of each token as a target;
        group_task: the task index of each group (group g is group_task[g - 1])."""
        ids = np.empty((rows, length), np.int32)
        w = np.empty((rows, length), np.float32)
        ans = np.empty((rows, length), np.int32)
        group_task: list[int] = []
        for b in range(rows):
            r = self.row(length, retrieval)
            i, ww, a = r.arrays()
            assert len(i) == length, (len(i), length)
            ids[b], w[b] = i, ww
            ans[b] = np.where(a > 0, a + len(group_task), 0)
            group_task += r.groups
        return ids, w, ans, np.asarray(group_task, np.int32)


class Prefetcher:
    """Makes batches in a background thread; the phase follows the schedule's progress."""

    def __init__(self, batches: Batches, phases, progress, depth: int = 3) -> None:
        self.batches, self.phases, self.progress = batches, phases, progress
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            rng = random.Random(self.batches.rng.random())
            while not self.stop.is_set():
                pi = phase_at(self.progress(), self.phases)
                p = self.phases[pi]
                length = rng.choices(p.lengths, p.weights)[0]
                rows = max(1, p.tokens_per_step // length)
                item = (pi, length, self.batches.batch(rows, length, p.retrieval))
                while not self.stop.is_set():
                    try:
                        self.q.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e

    def get(self):
        while True:
            if self.error is not None:
                raise self.error
            try:
                return self.q.get(timeout=1.0)
            except queue.Empty:
                continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def lr_at(progress: float, peak: float, warmup: float = 0.03) -> float:
    warm = min(1.0, (progress + 1e-4) / warmup)
    cos = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak * warm * cos


# -- kernels -------------------------------------------------------------------------------------------


def err_ratio(a, b) -> float:
    """RMS of the difference over RMS of the reference (fla's own test measure)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).pow(2).mean().sqrt() / (b.pow(2).mean().sqrt() + 1e-12))


def check_gdn(fn, ref, device, heads: int, dk: int, dv: int) -> dict[str, float]:
    """fla's test recipe at this model's head shape: forward output and every gradient."""
    import torch
    import torch.nn.functional as F

    g0 = torch.Generator(device="cpu").manual_seed(0)
    B, T = 2, 320  # not a multiple of the 64-token chunk

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.rand(*shape, generator=g0).to(device=device, dtype=dtype)

    q, k, v = rnd(B, T, heads, dk), rnd(B, T, heads, dk), rnd(B, T, heads, dv)
    beta = rnd(B, T, heads, dtype=torch.float32).sigmoid().to(torch.bfloat16)
    g = F.logsigmoid(rnd(B, T, heads, dtype=torch.float32))
    do = torch.randn(B, T, heads, dv, generator=g0).to(device=device, dtype=torch.bfloat16)
    results = []
    for f in (fn, ref):
        xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        o, _ = f(
            xs[0],
            xs[1],
            xs[2],
            g=xs[3],
            beta=xs[4],
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )
        grads = torch.autograd.grad(o.float(), xs, do.float())
        results.append([o] + list(grads))
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    return {n: err_ratio(a, b) for n, a, b in zip(names, results[0], results[1])}


def check_conv(fn, ref, device, channels: int) -> dict[str, float]:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(2, channels, 300, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(channels, 4, generator=gen) * 0.5).to(device)
    do = torch.randn(2, channels, 300, generator=gen).to(device=device, dtype=torch.bfloat16)
    results = []
    for f in (fn, ref):
        xs, ws = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            y = f(xs, ws, None, activation="silu")
        gx, gw = torch.autograd.grad(y.float(), [xs, ws], do.float())
        results.append([y, gx, gw])
    return {n: err_ratio(a, b) for n, a, b in zip(["y", "dx", "dw"], results[0], results[1])}


_TORCH_FUNCTIONS: dict = {}


def torch_functions(mq):
    """transformers' own torch Gated DeltaNet and causal conv (under its kernel-hub wrappers), taken
    before this script replaces the module's attributes."""
    if not _TORCH_FUNCTIONS:
        _TORCH_FUNCTIONS["gdn"] = inspect.unwrap(mq.torch_chunk_gated_delta_rule)
        _TORCH_FUNCTIONS["conv"] = inspect.unwrap(mq.causal_conv1d_fn)
    return _TORCH_FUNCTIONS["gdn"], _TORCH_FUNCTIONS["conv"]


GDN_TOLERANCE = 0.02  # fla's own test bound for these gradients; the Hopper bug (fla #640) gave dg 0.04
CONV_TOLERANCE = 0.02


def select_kernels(mq, cfg, device, gdn_choice: str, conv_choice: str) -> dict:
    """Install the Gated DeltaNet and causal-conv implementations in transformers' module (mq) and
    return what was chosen and why. transformers calls mq.torch_chunk_gated_delta_rule and
    mq.causal_conv1d_fn by their module-level names, so replacing those attributes is enough."""
    torch_gdn, torch_conv = torch_functions(mq)
    info: dict = {"gdn": "torch", "conv": "torch"}
    want_gdn = gdn_choice == "fla" or (gdn_choice == "auto" and device.type == "cuda")
    want_conv = conv_choice == "fla" or (conv_choice == "auto" and device.type == "cuda")
    fla_mod = None
    if want_gdn or want_conv:
        try:
            import triton

            info["triton"] = triton.__version__
            if device.type == "cuda":
                import torch
                from packaging.version import Version

                cap = torch.cuda.get_device_capability(device)
                if cap[0] == 9 and Version("3.4.0") <= Version(triton.__version__.split("+")[0]) < Version("3.7.1"):
                    # fla #640: Triton 3.4-3.7.0 miscompiles a transposed wgmma result in the gated
                    # backward on Hopper; without wgmma (MMA v2) the kernel is checked below.
                    os.environ["DISABLE_MMA_V3"] = "1"
                    info["disable_mma_v3"] = True
            import fla  # noqa: F401
            import fla.ops.common.chunk_o as chunk_o
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            info["fla"] = getattr(fla, "__version__", "?")
            if info.get("disable_mma_v3") and getattr(chunk_o, "IS_NVIDIA_HOPPER", False):
                chunk_o.IS_NVIDIA_HOPPER = False  # lifts only the Hopper guard; the check below decides
                info["fla_hopper_guard_lifted"] = True
            fla_mod = chunk_gated_delta_rule
        except Exception as e:  # noqa: BLE001
            info["fla_error"] = f"{type(e).__name__}: {e}"[:300]

    def fla_gdn(
        query,
        key,
        value,
        g,
        beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=None,
        **kwargs,
    ):
        return fla_mod(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
        )

    chosen_gdn, chosen_conv = torch_gdn, torch_conv
    if want_gdn and fla_mod is not None:
        try:
            heads = cfg.linear_num_value_heads
            ratios = check_gdn(fla_gdn, torch_gdn, device, heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            info["gdn_check"] = {k: round(v, 5) for k, v in ratios.items()}
            if max(ratios.values()) <= GDN_TOLERANCE:
                chosen_gdn, info["gdn"] = fla_gdn, "fla"
            else:
                info["gdn_reason"] = f"fla differs from the torch reference (> {GDN_TOLERANCE})"
        except Exception as e:  # noqa: BLE001
            info["gdn_reason"] = f"fla failed its check: {type(e).__name__}: {e}"[:300]
    elif want_gdn:
        info["gdn_reason"] = "fla did not import"
    if want_conv and fla_mod is not None:
        try:
            from fla.modules.causal_conv1d import causal_conv1d as fla_conv1d

            def fla_conv(hidden_states, weight, bias=None, activation=None, **kwargs):
                x = hidden_states.transpose(1, 2)  # [B, D, T] -> fla's [B, T, D]
                y, _ = fla_conv1d(
                    x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), activation=activation
                )
                return y.transpose(1, 2)

            ratios = check_conv(fla_conv, torch_conv, device, 96)
            info["conv_check"] = {k: round(v, 5) for k, v in ratios.items()}
            if max(ratios.values()) <= CONV_TOLERANCE:
                chosen_conv, info["conv"] = fla_conv, "fla"
            else:
                info["conv_reason"] = f"fla differs from the torch reference (> {CONV_TOLERANCE})"
        except Exception as e:  # noqa: BLE001
            info["conv_reason"] = f"fla failed its check: {type(e).__name__}: {e}"[:300]
    mq.torch_chunk_gated_delta_rule = chosen_gdn
    mq.causal_conv1d_fn = chosen_conv
    return info


def sdpa_context_factory(device):
    """A context that keeps SDPA off its O(L^2)-memory math path on the GPU (None: no restriction)."""

    if device.type != "cuda":
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    return lambda: sdpa_kernel(backends)


# -- checkpoints -----------------------------------------------------------------------------------


def pack(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """First-fit decreasing: names grouped into as few files of at most `limit` bytes as it finds."""
    bins: list[tuple[int, list[str]]] = []
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        for i, (used, names) in enumerate(bins):
            if used + sizes[name] <= limit:
                bins[i] = (used + sizes[name], names + [name])
                break
        else:
            bins.append((sizes[name], [name]))
    return [sorted(names) for _, names in bins]


def write_shards(tensors: dict, out: Path, prefix: str, metadata: dict[str, str] | None = None) -> list[str]:
    from safetensors.torch import save_file

    groups = pack({k: t.numel() * t.element_size() for k, t in tensors.items()}, MAX_FILE_BYTES)
    names = []
    for i, group in enumerate(groups):
        name = f"{prefix}-{i + 1:05d}.safetensors"
        tmp = out / f".{name}.tmp"
        meta = {"format": "pt", **(metadata if i == 0 and metadata else {})}
        save_file({k: tensors[k] for k in group}, str(tmp), metadata=meta)
        os.replace(tmp, out / name)
        names.append(name)
    for old in out.glob(f"{prefix}-*.safetensors"):
        if old.name not in names:
            old.unlink()
    return names


def save_checkpoint(model, opt, out: Path, state: dict, with_optimizer: bool = True) -> list[str]:
    """fp32 weights (convert.py reads them), bf16 AdamW moments and the trainer state (for --resume)."""
    import torch

    tied = model.config.tie_word_embeddings
    weights = {
        k: v.detach().float().contiguous().cpu()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    names = write_shards(weights, out, "model")
    if with_optimizer and opt is not None:
        moments, steps = {}, {}
        by_param = {p: n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            n = by_param[p]
            moments[f"{n}.exp_avg"] = st["exp_avg"].detach().to(torch.bfloat16).contiguous().cpu()
            moments[f"{n}.exp_avg_sq"] = st["exp_avg_sq"].detach().to(torch.bfloat16).contiguous().cpu()
            steps[n] = float(st["step"])
        state = dict(state, adam_steps=sorted(set(steps.values())))
        names += write_shards(moments, out, "optim", {"trainer_state": json.dumps(state)})
    model.config.to_json_file(str(out / "config.json"))
    return names


def load_checkpoint(model, opt, path: Path, log_fn=log) -> dict:
    """Weights from model-*.safetensors; AdamW moments and trainer state from optim-*.safetensors."""
    import torch
    from safetensors import safe_open

    weights = {}
    for f in sorted(path.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                weights[k] = s.get_tensor(k)
    if not weights:
        raise SystemExit(f"no model-*.safetensors in {path}")
    if model.config.tie_word_embeddings:
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise SystemExit(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    state: dict = {}
    moments = {}
    for f in sorted(path.glob("optim-*.safetensors")):
        with safe_open(str(f), "pt") as s:
            meta = s.metadata() or {}
            if "trainer_state" in meta:
                state = json.loads(meta["trainer_state"])
            for k in s.keys():
                moments[k] = s.get_tensor(k)
    if moments and opt is not None:
        sd = opt.state_dict()
        names = {p: n for n, p in model.named_parameters()}
        index = 0
        step = float(state.get("adam_steps", [state.get("step", 0)])[-1])
        for group in opt.param_groups:
            for p in group["params"]:
                n = names[p]
                if f"{n}.exp_avg" in moments:
                    sd["state"][index] = {
                        "step": torch.tensor(step, dtype=torch.float32),
                        "exp_avg": moments[f"{n}.exp_avg"].float(),
                        "exp_avg_sq": moments[f"{n}.exp_avg_sq"].float(),
                    }
                index += 1
        opt.load_state_dict(sd)
        log_fn(f"resumed AdamW moments for {len(sd['state'])} tensors (step {step:.0f})")
    else:
        log_fn("resumed weights only (fresh AdamW state)")
    return state


# -- losses and evaluation -------------------------------------------------------------------------


def loss_terms(model, ids, w, ans):
    """Per-step loss parts from one forward: sum of text CE * weight, per-answer-token CE, and whether
    the argmax hits each answer token. ids [B, L]; w, ans [B, L - 1] (targets ids[:, 1:])."""
    import torch
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    head = model.lm_head.weight
    B, L, _ = hidden.shape
    text_sum = hidden.new_zeros((), dtype=torch.float32)
    step = max(1, 131072 // B)
    for s in range(0, L - 1, step):
        e = min(L - 1, s + step)
        logits = F.linear(hidden[:, s:e], head).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, s + 1 : e + 1].reshape(-1), reduction="none")
        text_sum = text_sum + (ce * w[:, s:e].reshape(-1)).sum()
    mask = ans > 0
    h = hidden[:, :-1][mask]
    targets = ids[:, 1:][mask]
    ans_logits = F.linear(h, head).float()
    ans_ce = F.cross_entropy(ans_logits, targets, reduction="none")
    hits = ans_logits.detach().argmax(-1) == targets
    return text_sum, ans_ce, hits


def heldout_loss(model, held: np.ndarray, length: int, tokens: int, device, ctx) -> float:
    import torch
    import torch.nn.functional as F

    n = max(1, min(tokens, len(held) - 1) // length)
    total, count = 0.0, 0
    with torch.no_grad(), ctx():
        for i in range(n):
            ids = torch.from_numpy(held[i * length : (i + 1) * length].astype(np.int64))[None].to(device)
            if ids.shape[1] < 2:
                break
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
            for s in range(0, ids.shape[1] - 1, 65536):
                e = min(ids.shape[1] - 1, s + 65536)
                logits = F.linear(hidden[0, s:e], model.lm_head.weight).float()
                total += float(F.cross_entropy(logits, ids[0, s + 1 : e + 1], reduction="sum"))
                count += e - s
    return total / max(1, count)


def needle_grid(model, batches: Batches, lengths, trials, device, ctx, deadline, on_row=None) -> dict:
    """Teacher-forced pass-key accuracy per (length, depth) with the task's own filler, as `cmpchat eval
    --needle` builds its prompts. A trial passes when the argmax gives the space and the 5 digits, then
    a non-digit (cmpchat's check: the continuation's first run of digits is the key)."""
    import torch

    pk, encode = batches.pk, batches.encode
    digits = torch.tensor(batches.digit, device=device)
    rng = random.Random(SEED + 1)
    grid: dict = {}
    cell_seconds = None
    for length in lengths:
        row: dict = {}
        for depth in NEEDLE_DEPTHS:
            predicted = 0.0 if cell_seconds is None else cell_seconds[1] * (length / cell_seconds[0]) ** 1.5
            if time.time() - T0 + predicted > deadline:
                row[f"{depth:.1f}"] = None
                continue
            t_cell = time.time()
            seqs, starts = [], []
            for _ in range(trials):
                key = pk.make_key(rng)
                prompt = pk.build_prompt(encode, length, depth, key)
                answer = pk.answer_ids(encode, key)[: pk.ANSWER_TOKENS_CHECKED]
                seqs.append(prompt + answer)  # the last position predicts the token after the key
                starts.append((len(prompt), answer))
            per_batch = max(1, 262144 // length)
            ok = 0
            with torch.no_grad(), ctx():
                for b in range(0, trials, per_batch):
                    ids = torch.tensor(seqs[b : b + per_batch], dtype=torch.long, device=device)
                    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
                    for j in range(ids.shape[0]):
                        p, answer = starts[b + j]
                        h = hidden[j, p - 1 : p + len(answer)]
                        pred = (h @ model.lm_head.weight.T).argmax(-1)
                        good = pred[:-1].tolist() == answer and not bool((pred[-1] == digits).any())
                        ok += good
            row[f"{depth:.1f}"] = ok / trials
            cell_seconds = (length, time.time() - t_cell)
        grid[str(length)] = row
        log(f"needle {length}: " + " ".join("-" if v is None else f"{v:.2f}" for v in row.values()))
        if on_row is not None:
            on_row(grid)
    return grid


def longest_at(grid: dict, threshold: float) -> int | None:
    best = None
    for length, row in grid.items():
        vals = list(row.values())
        if any(v is None for v in vals) or min(vals) < threshold:
            break
        best = int(length)
    return best


# -- main ------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(REPO / ".train"), help="corpus.py's output folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=460, help="training ends this many seconds after start")
    ap.add_argument("--deadline-s", type=float, default=565, help="no needle cell starts that would end after this")
    ap.add_argument("--save-every-s", type=float, default=60)
    ap.add_argument("--log-every-s", type=float, default=15)
    ap.add_argument(
        "--schedule-s",
        type=float,
        default=0,
        help="training seconds the lr and curriculum schedule spans, across resumed calls "
        "(0: what this call's budget leaves at the first step, plus the resumed seconds)",
    )
    ap.add_argument("--len-scale", type=float, default=1, help="divide the curriculum's lengths and batches")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: budget only)")
    ap.add_argument("--heldout-tokens", type=int, default=1_048_576)
    ap.add_argument("--heldout-len", type=int, default=8192)
    ap.add_argument("--needle-lengths", default="1024,2048,4096,8192,16384,32768,65536,131072")
    ap.add_argument("--needle-trials", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    ap.add_argument(
        "--gdn",
        choices=("auto", "fla", "torch"),
        default="auto",
        help="Gated DeltaNet kernel (auto: fla on a GPU if it passes its check)",
    )
    ap.add_argument("--conv", choices=("auto", "fla", "torch"), default="auto", help="causal conv kernel")
    ap.add_argument("--resume", default="", help="a folder this script wrote (weights, AdamW moments, state)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    sdpa_ctx = sdpa_context_factory(device)

    class Ctx:
        """bf16 autocast on the GPU (plus the SDPA backend restriction while it holds)."""

        def __init__(self) -> None:
            self.stack = []

        def __call__(self):
            return self

        def __enter__(self):
            import contextlib

            s = contextlib.ExitStack()
            if cuda:
                s.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
                if sdpa_ctx is not None:
                    s.enter_context(sdpa_ctx())
            self.stack.append(s)
            return self

        def __exit__(self, *exc):
            return self.stack.pop().__exit__(*exc)

    ctx = Ctx()

    data = Path(args.data)
    header, arrays = load_shard(data / "shard.bin")
    tok = Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    passkey = load_passkey()
    eos = tok.token_to_id("<|im_end|>")
    log(
        f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}"
        f"{' ' + torch.cuda.get_device_name(0) if cuda else ''}, "
        f"tokens {{{', '.join(f'{k}: {v.size}' for k, v in arrays.items())}}}"
    )

    spec = TINY if args.tiny else MODEL
    cfg = make_config(spec, header["vocab_size"], eos)
    kernels = select_kernels(mq, cfg, device, args.gdn, args.conv)
    log(f"kernels: {json.dumps(kernels)}")
    model = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"parameters {n_params} ({n_params / 1e6:.2f}M), layers {list(cfg.layer_types)}")

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim == 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        **({"fused": True} if cuda else {}),
    )

    resumed: dict = {}
    if args.resume:
        resumed = load_checkpoint(model, opt, Path(args.resume))
        log(f"resumed from {args.resume}: {json.dumps(resumed)}")
    step = int(resumed.get("step", 0))
    tokens_seen = int(resumed.get("tokens", 0))
    prior_train_s = float(resumed.get("train_seconds", 0.0))

    phases = scaled_phases(args.len_scale)
    batches = Batches(arrays, encode, passkey, f"{SEED}/{step}")
    held = arrays["heldout"]
    probe_len = phases[0].lengths[-1]
    probe = held[: min(len(held), 8 * probe_len)]  # a fixed held-out sample for the loss curve

    # One dry step of the real model: the kernels and the SDPA restriction in their real call path.
    dry = torch.from_numpy(held[:1024].astype(np.int64))[None].to(device)
    for _attempt in range(3):
        try:
            with ctx():
                loss = mq_loss = model(input_ids=dry, labels=dry, use_cache=False).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            break
        except Exception as e:  # noqa: BLE001
            log(f"dry step failed ({type(e).__name__}: {str(e)[:200]})")
            model.zero_grad(set_to_none=True)
            trace = traceback.format_exc()
            fast = kernels["gdn"] != "torch" or kernels["conv"] != "torch"
            if fast and ("/fla/" in trace or "triton" in trace or sdpa_ctx is None):
                kernels = dict(select_kernels(mq, cfg, device, "torch", "torch"), reason="the dry step failed with fla")
            elif sdpa_ctx is not None:
                sdpa_ctx = None
                kernels["sdpa"] = "unrestricted (the restricted dry step failed)"
            else:
                raise
    else:
        raise SystemExit("the dry step failed with every fallback")
    if kernels["gdn"] != "torch" or kernels["conv"] != "torch":
        fast = {"gdn": mq.torch_chunk_gated_delta_rule, "conv": mq.causal_conv1d_fn}
        mq.torch_chunk_gated_delta_rule, mq.causal_conv1d_fn = torch_functions(mq)
        with torch.no_grad(), ctx():
            ref_loss = model(input_ids=dry, labels=dry, use_cache=False).loss
        mq.torch_chunk_gated_delta_rule, mq.causal_conv1d_fn = fast["gdn"], fast["conv"]
        kernels["dry_loss_fast_vs_torch"] = [round(float(mq_loss), 5), round(float(ref_loss), 5)]
        if abs(float(mq_loss) - float(ref_loss)) > 0.02 * max(1.0, abs(float(ref_loss))):
            kernels = dict(select_kernels(mq, cfg, device, "torch", "torch"), reason="model loss differs with fla")
    kernels.setdefault("sdpa", "flash/efficient/cudnn only" if sdpa_ctx is not None else "default")
    log(f"kernels in use: {json.dumps(kernels)}")

    log_f = open(out / "train_log.jsonl", "a" if args.resume else "w")
    train_start = time.time()
    schedule_s = (
        args.schedule_s or float(resumed.get("schedule_s", 0)) or (prior_train_s + args.budget_s - (train_start - T0))
    )

    def train_seconds() -> float:
        return prior_train_s + time.time() - train_start

    def progress() -> float:
        return train_seconds() / schedule_s

    prefetch = Prefetcher(batches, phases, progress)
    summary = {
        "parameters": n_params,
        "config": dict(spec),
        "vocab_size": header["vocab_size"],
        "kernels": kernels,
        "phases": [p.__dict__ for p in phases],
        "answer_lambda": ANSWER_LAMBDA,
        "tasks": list(TASKS),
        "peak_lr": args.lr,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "fla": kernels.get("fla"),
            "triton": kernels.get("triton"),
        },
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "seed": SEED,
        "resumed_from": resumed or None,
    }

    def state() -> dict:
        return {
            "step": step,
            "tokens": tokens_seen,
            "train_seconds": round(train_seconds(), 2),
            "schedule_s": schedule_s,
            "seed": SEED,
        }

    rec: dict = {}
    first_step = step

    def weights_finite() -> bool:
        return bool(torch.stack([p.detach().isfinite().all() for p in model.parameters()]).all())

    last_save = last_log = time.time()
    log_tokens, log_time = tokens_seen, time.time()
    pending: list = []  # (text_sum, n_text, ans_ce, hits, group ids, group tasks) since the last log
    model.train()
    while True:
        now = time.time()
        if now - T0 >= args.budget_s or progress() >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        pi, length, (ids_np, w_np, ans_np, group_task) = prefetch.get()
        ids = torch.from_numpy(ids_np.astype(np.int64)).to(device, non_blocking=True)
        w = torch.from_numpy(w_np[:, 1:]).to(device, non_blocking=True)
        ans = torch.from_numpy(ans_np[:, 1:]).to(device, non_blocking=True)
        n_text = float(w_np[:, 1:].sum())
        n_ans = int((ans_np[:, 1:] > 0).sum())
        lr = lr_at(progress(), args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        with ctx():
            text_sum, ans_ce, hits = loss_terms(model, ids, w, ans)
        loss = text_sum / max(1.0, n_text)
        if n_ans:
            loss = loss + ANSWER_LAMBDA * ans_ce.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += ids.numel()
        pending.append((pi, length, text_sum.detach(), n_text, ans_ce.detach(), hits, ans_np[:, 1:], group_task))
        now = time.time()
        if now - last_log > args.log_every_s or step <= first_step + 3:
            rec = {
                "step": step,
                "tokens": tokens_seen,
                "seconds": round(now - T0, 1),
                "train_seconds": round(train_seconds(), 1),
                "lr": lr,
                "phase": pi,
                "seq_len": length,
            }
            text = sum(float(p[2]) for p in pending) / max(1.0, sum(p[3] for p in pending))
            per_task: dict[str, list[float]] = {}
            for p in pending:
                if p[4].numel() == 0:
                    continue
                hit = p[5].cpu().numpy()
                group = p[6][p[6] > 0]  # the same row-major order as the boolean mask on the GPU
                exact = np.ones(len(p[7]), bool)
                np.logical_and.at(exact, group - 1, hit)
                for gi, task in enumerate(p[7]):
                    per_task.setdefault(TASKS[task], [0, 0, 0.0, 0])
                    per_task[TASKS[task]][0] += 1
                    per_task[TASKS[task]][1] += int(exact[gi])
                for task in set(p[7].tolist()):
                    sel = np.isin(group - 1, np.flatnonzero(p[7] == task))
                    per_task[TASKS[task]][2] += float(hit[sel].sum())
                    per_task[TASKS[task]][3] += int(sel.sum())
            ans_all = [p[4] for p in pending if p[4].numel()]
            rec["train_loss"] = text
            rec["answer_loss"] = float(torch.cat(ans_all).mean()) if ans_all else None
            rec["answers"] = {
                k: {"questions": v[0], "exact": round(v[1] / v[0], 4), "token_hit": round(v[2] / max(1, v[3]), 4)}
                for k, v in sorted(per_task.items())
            }
            model.eval()
            rec["heldout_loss"] = heldout_loss(model, probe, probe_len, len(probe), device, ctx)
            model.train()
            rec["tokens_per_s"] = round((tokens_seen - log_tokens) / max(1e-6, now - log_time))
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            exact_txt = " ".join(f"{k}={v['exact']:.2f}" for k, v in rec["answers"].items())
            log(
                f"step {step} tok {tokens_seen / 1e6:.1f}M {rec['tokens_per_s'] / 1e3:.0f}K tok/s phase {pi} "
                f"len {length} lr {lr:.2e} loss {text:.3f} ans {rec['answer_loss'] or float('nan'):.3f} "
                f"held {rec['heldout_loss']:.3f} exact {exact_txt}"
            )
            pending.clear()
            last_log = now
            log_tokens, log_time = tokens_seen, time.time()
        bad = not math.isfinite(rec.get("train_loss", 0.0))
        if now - last_save > args.save_every_s or bad:
            if not bad and weights_finite():
                save_checkpoint(model, opt, out, state())
            elif (out / "model-00001.safetensors").is_file():
                # Not finite: back to the last checkpoint at half the learning rate (never saves a NaN).
                load_checkpoint(model, opt, out)
                args.lr *= 0.5
                rec["train_loss"] = 0.0
                log(f"non-finite loss: reloaded the last checkpoint, peak lr now {args.lr:.2e}")
            else:
                raise SystemExit("non-finite loss before the first checkpoint")
            last_save = time.time()
    prefetch.close()
    train_s = time.time() - train_start
    last_bad = step > first_step and not math.isfinite(float(loss.detach()))
    if (last_bad or not weights_finite()) and (out / "model-00001.safetensors").is_file():
        load_checkpoint(model, opt, out)
        log("non-finite loss at the end: the last checkpoint is the result")
    shards = save_checkpoint(model, opt, out, state())
    log(
        f"trained {step} steps, {tokens_seen} tokens ({tokens_seen / max(1e-6, train_s) / 1e3:.0f}K tok/s) "
        f"in {train_s:.0f}s; saved {shards}"
    )

    model.eval()
    summary.update(
        {
            "steps": step,
            "tokens_seen": tokens_seen,
            "train_seconds": round(train_seconds(), 1),
            "schedule_s": round(schedule_s, 1),
            "final_train_loss": rec.get("train_loss"),
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        }
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["heldout_loss"] = heldout_loss(model, held, args.heldout_len, args.heldout_tokens, device, ctx)
    summary["heldout_tokens"] = min(args.heldout_tokens, len(held) - 1) // args.heldout_len * args.heldout_len
    log(f"held-out loss {summary['heldout_loss']:.4f} (ppl {math.exp(summary['heldout_loss']):.2f})")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lengths = [int(x) for x in args.needle_lengths.split(",") if x]

    def on_row(grid: dict) -> None:
        summary["needle"] = {
            "trials": args.needle_trials,
            "filler": "the task's own sentences",
            "teacher_forced": True,
            "grid": grid,
            "longest_at_0.90": longest_at(grid, 0.9),
            "longest_at_0.95": longest_at(grid, 0.95),
        }
        summary["total_seconds"] = round(time.time() - T0, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    needle_grid(model, batches, lengths, args.needle_trials, device, ctx, args.deadline_s, on_row)
    log("done")


if __name__ == "__main__":
    main()
