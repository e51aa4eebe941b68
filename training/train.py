#!/usr/bin/env python3
"""Train the small Qwen3.5 with transformers' own implementation, within a wall-clock budget.

Reads the token shard and tokenizer that corpus.py wrote (--data), trains a Qwen3_5ForCausalLM of the
shape in MODEL (the released layer pattern and head sizes, narrow and shallow), and writes to --out:

    model-0000N.safetensors   fp32 weights in shards of at most 15 MiB (what the device tool brings back)
    config.json               the transformers config
    train_log.jsonl           one line per logged step: step, tokens, seconds, lr, train loss, held-out loss
    summary.json              figures for the model card: sizes, steps, tokens, losses, the needle grid

Every sequence is corpus text (code, docs, man pages; a tenth of them chat samples); half of them also
carry a pass-key task (cmpchat/evaluation/passkey.py: a key sentence at a random depth, the question at
the end, then the answer), whose answer tokens weigh ANSWER_WEIGHT times a text token in the loss. The
filler around a key is corpus text or, for some, the task's own repeated filler sentences. Sequences are
2K tokens for the first CURRICULUM_SHORT of the budget, then 8K with some of 16K and 32K.

The learning rate follows the elapsed fraction of --budget-s (linear warm-up over the first steps, then
cosine to a tenth), so a run uses its budget whatever the machine's speed; the data order is seeded.
After training: held-out loss over --heldout-tokens tokens, then the pass-key grid (teacher-forced: a
trial passes when the model's argmax gives every answer token), each cell skipped once --deadline-s
is near. Checkpoints are also written every --save-every-s seconds.

Smoke test on a CPU: python training/train.py --data .train --out /tmp/t --tiny --budget-s 60
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import lzma
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

T0 = time.time()
HERE = Path(__file__).resolve().parent
REPO = HERE.parent

MODEL = dict(  # the released models' layer pattern and head sizes, narrow and shallow
    hidden_size=256,
    intermediate_size=320,
    num_hidden_layers=8,
    full_attention_interval=4,  # layers 3 and 7 are gated attention
    num_attention_heads=1,
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
ANSWER_WEIGHT = 100.0
NEEDLE_FRACTION = 0.5
OWN_FILLER_FRACTION = 0.3
CHAT_FRACTION = 0.1
CURRICULUM_SHORT = 0.2
NEEDLE_DEPTHS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


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


class Batches:
    """Seeded sequences of corpus text, chat samples and pass-key tasks, with per-token loss weights."""

    def __init__(self, arrays: dict[str, np.ndarray], encode, passkey, eot: int, seed: int) -> None:
        self.train, self.chat = arrays["train"], arrays["chat"]
        self.encode, self.pk, self.eot = encode, passkey, eot
        self.rng = random.Random(seed)
        self.own_filler = encode(passkey.FILLER)

    def text(self, n: int, source: np.ndarray | None = None) -> np.ndarray:
        src = source if source is not None else self.train
        start = self.rng.randrange(0, len(src) - n - 1)
        return src[start : start + n]

    def sequence(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        r = self.rng.random()
        weights = np.ones(length, np.float32)
        if r < NEEDLE_FRACTION:
            key = self.pk.make_key(self.rng)
            answer = self.pk.answer_ids(self.encode, key)
            prompt_len = length - len(answer) - 1
            filler = None
            if self.rng.random() >= OWN_FILLER_FRACTION:
                filler = self.text(prompt_len).tolist()
            depth = self.rng.random()
            prompt = self.pk.build_prompt(self.encode, prompt_len, depth, key, filler)
            ids = np.asarray(prompt + answer + [self.eot], np.int32)
            # weights[t] belongs to predicting token t (shifted in the loss)
            weights[len(prompt) : len(prompt) + self.pk.ANSWER_TOKENS_CHECKED] = ANSWER_WEIGHT
            return ids, weights
        source = self.chat if r < NEEDLE_FRACTION + CHAT_FRACTION and len(self.chat) > length + 2 else None
        return self.text(length, source).copy(), weights

    def batch(self, batch: int, length: int):
        seqs = [self.sequence(length) for _ in range(batch)]
        return np.stack([s[0] for s in seqs]), np.stack([s[1] for s in seqs])


def lr_at(progress: float, step: int, peak: float, warmup: int) -> float:
    warm = min(1.0, (step + 1) / warmup)
    cos = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak * warm * cos


def save_checkpoint(model, out: Path, max_shard_bytes: int = 15 * 2**20) -> list[str]:
    """fp32 safetensors shards + config.json (convert.py adds the shard index that from_pretrained reads)."""
    from safetensors.torch import save_file

    state = {
        k: v.detach().float().contiguous().cpu()
        for k, v in model.state_dict().items()
        if not (model.config.tie_word_embeddings and k == "lm_head.weight")
    }
    shards, cur, size = [], {}, 0
    for k in sorted(state):
        n = state[k].numel() * 4
        if cur and size + n > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = state[k]
        size += n
    shards.append(cur)
    names = []
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}.safetensors"
        tmp = out / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / name)
        names.append(name)
    for old in out.glob("model-*.safetensors"):
        if old.name not in names:
            old.unlink()
    model.config.to_json_file(str(out / "config.json"))
    return names


def token_losses(model, ids, weights=None):
    """Per-token cross entropy of predicting ids[:, 1:], LM head applied in slices to bound memory."""
    import torch
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    head = model.lm_head.weight
    B, L, _ = hidden.shape
    out = []
    step = max(1, 65536 // B)
    for s in range(0, L - 1, step):
        e = min(L - 1, s + step)
        logits = F.linear(hidden[:, s:e], head).float()
        out.append(
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, s + 1 : e + 1].reshape(-1), reduction="none"
            ).view(B, e - s)
        )
    return torch.cat(out, dim=1)


def heldout_loss(model, held: np.ndarray, length: int, tokens: int, device, autocast) -> float:
    import torch

    n = max(1, min(tokens, len(held) - 1) // length)
    total, count = 0.0, 0
    with torch.no_grad(), autocast():
        for i in range(n):
            ids = torch.from_numpy(held[i * length : (i + 1) * length].astype(np.int64))[None].to(device)
            if ids.shape[1] < 2:
                break
            loss = token_losses(model, ids)
            total += float(loss.sum())
            count += loss.numel()
    return total / max(1, count)


def needle_grid(model, batches: Batches, lengths, trials, device, autocast, deadline) -> dict:
    """Teacher-forced pass-key accuracy per (length, depth) with the task's own filler, as `cmpchat eval`."""
    import torch

    pk, encode = batches.pk, batches.encode
    rng = random.Random(SEED + 1)
    grid = {}
    for length in lengths:
        row = {}
        for depth in NEEDLE_DEPTHS:
            if time.time() - T0 > deadline:
                row[f"{depth:.1f}"] = None
                continue
            seqs, starts = [], []
            for _ in range(trials):
                key = pk.make_key(rng)
                prompt = pk.build_prompt(encode, length, depth, key)
                answer = pk.answer_ids(encode, key)[: pk.ANSWER_TOKENS_CHECKED]
                seqs.append(prompt + answer[:-1])
                starts.append((len(prompt), answer))
            per_batch = max(1, 262144 // length)
            ok = 0
            with torch.no_grad(), autocast():
                for b in range(0, trials, per_batch):
                    ids = torch.tensor(seqs[b : b + per_batch], dtype=torch.long, device=device)
                    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
                    for j in range(ids.shape[0]):
                        p, answer = starts[b + j]
                        h = hidden[j, p - 1 : p - 1 + len(answer)]
                        pred = (h @ model.lm_head.weight.T).argmax(-1).tolist()
                        ok += pred == answer
            row[f"{depth:.1f}"] = ok / trials
        grid[str(length)] = row
        log(f"needle {length}: " + " ".join("-" if v is None else f"{v:.2f}" for v in row.values()))
    return grid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(REPO / ".train"), help="corpus.py's output folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=480, help="training ends this many seconds after start")
    ap.add_argument("--deadline-s", type=float, default=575, help="evaluations stop starting cells after this")
    ap.add_argument("--save-every-s", type=float, default=120)
    ap.add_argument("--tokens-per-step", type=int, default=131072)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--short-len", type=int, default=2048)
    ap.add_argument("--long-lens", default="16384,32768", help="longer sequence lengths mixed in")
    ap.add_argument("--long-every", type=int, default=4, help="every Nth step uses a long length")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: budget only)")
    ap.add_argument("--heldout-tokens", type=int, default=1_048_576)
    ap.add_argument("--needle-lengths", default="8192,16384,32768,65536,131072")
    ap.add_argument("--needle-trials", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    ap.add_argument("--chunk-size", type=int, default=64, help="Gated DeltaNet chunk of the torch path")
    args = ap.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

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

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    data = Path(args.data)
    header, arrays = load_shard(data / "shard.bin")
    tok = Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    passkey = load_passkey()
    eot, eos = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    log(
        f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}, "
        f"tokens {{{', '.join(f'{k}: {v.size}' for k, v in arrays.items())}}}"
    )

    if args.chunk_size != 64:
        import functools

        mq.torch_chunk_gated_delta_rule = functools.partial(mq.torch_chunk_gated_delta_rule, chunk_size=args.chunk_size)
    cfg = make_config(TINY if args.tiny else MODEL, header["vocab_size"], eos)
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

    batches = Batches(arrays, encode, passkey, eot, SEED)
    held = arrays["heldout"]
    probe = held[: min(len(held), 8 * args.short_len)]  # a fixed held-out sample for the loss curve
    long_lens = [int(x) for x in args.long_lens.split(",") if x]
    log_f = open(out / "train_log.jsonl", "w")
    train_start = time.time()
    train_budget = args.budget_s - (train_start - T0)
    step, tokens_seen, last_save, last_log = 0, 0, time.time(), time.time()
    losses, answer_hits = [], []
    model.train()
    while True:
        elapsed = time.time() - train_start
        if elapsed >= train_budget or (args.max_steps and step >= args.max_steps):
            break
        progress = elapsed / train_budget
        if progress < CURRICULUM_SHORT:
            length = args.short_len
        elif long_lens and step % args.long_every == args.long_every - 1:
            length = long_lens[(step // args.long_every) % len(long_lens)]
        else:
            length = args.seq_len
        bsz = max(1, args.tokens_per_step // length)
        ids_np, w_np = batches.batch(bsz, length)
        ids = torch.from_numpy(ids_np.astype(np.int64)).to(device, non_blocking=True)
        w = torch.from_numpy(w_np[:, 1:]).to(device, non_blocking=True)
        lr = lr_at(progress, step, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast():
            ce = token_losses(model, ids)
        loss = (ce * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += ids.numel()
        text_mask = w == 1.0
        ce = ce.detach()
        losses.append(float((ce * text_mask).sum() / text_mask.sum()))
        answer = w > 1.0
        if bool(answer.any()):
            answer_hits.append(float((ce[answer] < 0.69).float().mean()))  # p(answer token) > 1/2
        now = time.time()
        if now - last_log > 15 or step <= 3:
            model.eval()
            h_loss = heldout_loss(model, probe, args.short_len, len(probe), device, autocast)
            model.train()
            rec = {
                "step": step,
                "tokens": tokens_seen,
                "seconds": round(now - T0, 1),
                "lr": lr,
                "seq_len": length,
                "train_loss": float(np.mean(losses[-20:])),
                "heldout_loss": h_loss,
                "answer_token_hit": float(np.mean(answer_hits[-20:])) if answer_hits else None,
            }
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            log(
                f"step {step} tok {tokens_seen / 1e6:.1f}M len {length} lr {lr:.2e} loss {rec['train_loss']:.3f} "
                f"held {h_loss:.3f} ans {rec['answer_token_hit']}"
            )
            last_log = now
        if now - last_save > args.save_every_s:
            save_checkpoint(model, out)
            last_save = now
    train_seconds = time.time() - train_start
    shards = save_checkpoint(model, out)
    log(f"trained {step} steps, {tokens_seen} tokens in {train_seconds:.0f}s; saved {shards}")

    model.eval()
    summary = {
        "parameters": n_params,
        "config": {k: v for k, v in (TINY if args.tiny else MODEL).items()},
        "vocab_size": header["vocab_size"],
        "steps": step,
        "tokens_seen": tokens_seen,
        "train_seconds": round(train_seconds, 1),
        "tokens_per_step": args.tokens_per_step,
        "seq_lens": {"short": args.short_len, "main": args.seq_len, "long": long_lens},
        "peak_lr": args.lr,
        "final_train_loss": float(np.mean(losses[-20:])) if losses else None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        "seed": SEED,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["heldout_loss"] = heldout_loss(model, held, args.seq_len, args.heldout_tokens, device, autocast)
    summary["heldout_tokens"] = min(args.heldout_tokens, len(held) - 1) // args.seq_len * args.seq_len
    log(f"held-out loss {summary['heldout_loss']:.4f} (ppl {math.exp(summary['heldout_loss']):.2f})")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lengths = [int(x) for x in args.needle_lengths.split(",") if x]
    summary["needle"] = {
        "trials": args.needle_trials,
        "filler": "the task's own sentences",
        "teacher_forced": True,
        "grid": needle_grid(model, batches, lengths, args.needle_trials, device, autocast, args.deadline_s),
    }
    summary["total_seconds"] = round(time.time() - T0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log("done")


if __name__ == "__main__":
    main()
