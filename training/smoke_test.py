#!/usr/bin/env python3
"""CPU checks of train.py's parts, before a GPU run (a minute or two with the training venv):

    python training/smoke_test.py [--data .train]

1. the curriculum's rows: exact lengths; the pass-key rows are token for token cmpchat's pass-key
   prompt (passkey.build_prompt) plus the answer; text weights are 1 on corpus text and the needle's
   copied key, 0 on templates and repeated fillers; answer groups cover exactly each asked value's
   tokens, and a record row's answers are the values its needles give the asked names;
2. the loss terms against a direct computation; the answer hit rate of an oracle;
3. the kernel check: transformers' torch Gated DeltaNet against itself passes, a perturbed one fails,
   and select_kernels falls back to torch when fla cannot run (here: no GPU);
4. the needle grid's index arithmetic, with an oracle model (all pass) and an off-by-one one (none);
5. checkpoints: the full-size model's weights and bf16 AdamW moments fit in 2 + 2 files of < 16 MiB;
   a tiny model's save and --resume round trip (weights exact, moments to bf16, trainer state).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train  # noqa: E402


def check_rows(batches: train.Batches, decode) -> None:
    pk = batches.pk
    seen_kinds = set()
    for length in (128, 512, 2048, 8192):
        for _ in range(60 if length < 8192 else 12):
            row = batches.passkey_row(length)
            ids, w, ans = row.arrays()
            assert len(ids) == len(w) == len(ans) == length
            p = batches.last_passkey
            seen_kinds.add(p["kind"])
            filler = None if p["kind"] == "own" else p["filler"]
            prompt = pk.build_prompt(batches.encode, length - 7, p["depth"], p["key"], filler)
            answer = pk.answer_ids(batches.encode, p["key"])
            assert ids.tolist() == prompt + answer, "a pass-key row differs from cmpchat's prompt"
            assert (
                (ans > 0).sum() == 7
                and (ans[-7:] == 1).all()
                and row.groups == [train.TASKS.index(f"passkey/{p['kind']}")]
            )
            needle = batches.encode(pk.NEEDLE.format(key=p["key"]))
            # text weight: the corpus filler (1) or none (repeated fillers), plus the copied key's digits
            expect = (len(prompt) - len(needle) - len(batches.intro) - len(batches.question)) * (
                1.0 if p["kind"] == "corpus" else 0.0
            ) + 5
            assert abs(float(w.sum()) - expect) < 1e-3, (float(w.sum()), expect, p["kind"])
            assert w[: len(batches.intro)].sum() == 0 and w[-7 - len(batches.question) :].sum() == 0
    assert seen_kinds == {"corpus", "own", "snippet"}, seen_kinds

    for length in (256, 1024, 4096):
        for _ in range(80):
            row = batches.records_row(length)
            ids, w, ans = row.arrays()
            assert len(ids) == length
            text = decode(ids.tolist())
            assert row.groups, "a record row without a question"
            for g in range(1, len(row.groups) + 1):
                value = decode(ids[ans == g].tolist())
                assert value.startswith(" ") and value.endswith(".") and value[1:-1].isdigit(), value
                # the question just before the answer names someone whose needle gives this value
                before = decode(ids[: int(np.flatnonzero(ans == g)[0])].tolist())
                asked = next(n for n in batches.names if before.endswith(n + " is") or n + "?" in before[-90:])
                assert any(
                    f.format(name=asked, value=" " + value[1:-1]).strip() in text for f, _, _ in train.RECORD_FORMATS
                ), (asked, value)
            assert w[ans > 0].sum() == 0
    # whole batches: global answer groups and their tasks
    ids, w, ans, tasks = batches.batch(8, 1024, 0.75)
    assert ids.shape == (8, 1024) and ans.max() == len(tasks)
    print("rows: pass-key rows equal cmpchat's prompts; weights and answer groups as specified")


def check_losses(model, batches, torch) -> None:
    import torch.nn.functional as F

    ids_np, w_np, ans_np, _ = batches.batch(3, 256, 1.0)
    ids = torch.from_numpy(ids_np.astype(np.int64))
    w, ans = torch.from_numpy(w_np[:, 1:]), torch.from_numpy(ans_np[:, 1:])
    with torch.no_grad():
        text_sum, ans_ce, hits = train.loss_terms(model, ids, w, ans)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        ce = ce.view(ids.shape[0], -1)
    assert torch.allclose(text_sum, (ce * w).sum(), rtol=1e-4), (text_sum, (ce * w).sum())
    assert torch.allclose(ans_ce, ce[ans > 0], rtol=1e-4, atol=1e-5)
    assert hits.shape == ans_ce.shape
    print(f"losses: text sum {float(text_sum):.2f}, {ans_ce.numel()} answer tokens, as computed directly")


def check_kernels(mq, cfg, torch) -> None:
    import inspect

    ref = inspect.unwrap(mq.torch_chunk_gated_delta_rule)
    dev = torch.device("cpu")
    same = train.check_gdn(ref, ref, dev, 2, 32, 32)
    assert max(same.values()) == 0.0, same

    def perturbed(q, k, v, g, beta, **kw):  # a wrong dg: the decay scaled by 1.1
        return ref(q, k, v, g=g * 1.1, beta=beta, **kw)

    bad = train.check_gdn(perturbed, ref, dev, 2, 32, 32)
    assert bad["dg"] > train.GDN_TOLERANCE or bad["o"] > train.GDN_TOLERANCE, bad
    conv = inspect.unwrap(mq.causal_conv1d_fn)
    assert max(train.check_conv(conv, conv, dev, 16).values()) == 0.0
    info = train.select_kernels(mq, cfg, dev, "fla", "fla")
    assert info["gdn"] == "torch" and info["conv"] == "torch" and ("fla_error" in info or "gdn_reason" in info), info
    assert mq.torch_chunk_gated_delta_rule is ref
    print(
        f"kernels: check passes the reference ({same['o']}), fails a perturbed dg ({bad['dg']:.3f}); "
        f"fla on a CPU falls back: {info.get('gdn_reason') or info.get('fla_error')}"
    )


class Oracle:
    """A stand-in model whose argmax at position t is the token at t + shift (t + 1: always right),
    and a full stop after the sequence; lm_head is the identity."""

    def __init__(self, vocab: int, stop: int, shift: int, torch) -> None:
        self.torch, self.vocab, self.stop, self.shift = torch, vocab, stop, shift
        self.lm_head = type("H", (), {"weight": torch.eye(vocab)})()

    def model(self, input_ids, use_cache=False):
        t = self.torch
        nxt = t.full_like(input_ids, self.stop)
        s = self.shift
        nxt[:, : input_ids.shape[1] - s] = input_ids[:, s:]
        hidden = t.nn.functional.one_hot(nxt, self.vocab).float()
        return type("O", (), {"last_hidden_state": hidden})()


def check_needle(batches, vocab, stop, torch) -> None:
    import contextlib

    ctx = contextlib.nullcontext
    good = train.needle_grid(Oracle(vocab, stop, 1, torch), batches, [256], 3, torch.device("cpu"), ctx, 1e9)
    bad = train.needle_grid(Oracle(vocab, stop, 2, torch), batches, [256], 3, torch.device("cpu"), ctx, 1e9)
    assert all(v == 1.0 for v in good["256"].values()), good
    assert all(v == 0.0 for v in bad["256"].values()), bad
    assert train.longest_at(good, 0.9) == 256 and train.longest_at(bad, 0.9) is None
    print("needle grid: an oracle passes every cell, an off-by-one model none")


def check_checkpoints(mq, header, eos, torch) -> None:
    from transformers import Qwen3_5ForCausalLM

    cfg = train.make_config(train.MODEL, header["vocab_size"], eos)
    big = Qwen3_5ForCausalLM._from_config(cfg, dtype=torch.float32)
    n = sum(p.numel() for p in big.parameters())
    assert n <= 8_000_000, n
    with tempfile.TemporaryDirectory() as d:
        weights = {k: v.detach().contiguous() for k, v in big.state_dict().items() if k != "lm_head.weight"}
        moments = {}
        for k, v in weights.items():
            moments[k + ".exp_avg"] = v.to(torch.bfloat16)
            moments[k + ".exp_avg_sq"] = v.to(torch.bfloat16)
        a = train.write_shards(weights, Path(d), "model")
        b = train.write_shards(moments, Path(d), "optim", {"trainer_state": "{}"})
        sizes = [p.stat().st_size for p in Path(d).iterdir()]
        assert len(a) == 2 and len(b) == 2 and max(sizes) < 16 * 2**20, (a, b, sizes)
    print(f"checkpoint: {n} parameters; weights {a} and moments {b}, largest {max(sizes)} bytes (< 16 MiB)")

    cfg = train.make_config(train.TINY, header["vocab_size"], eos)
    model = Qwen3_5ForCausalLM._from_config(cfg, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, header["vocab_size"], (2, 64))
    for _ in range(2):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    with tempfile.TemporaryDirectory() as d:
        state = {"step": 2, "tokens": 256, "train_seconds": 1.5, "schedule_s": 10.0, "seed": 26}
        train.save_checkpoint(model, opt, Path(d), state)
        model2 = Qwen3_5ForCausalLM._from_config(cfg, dtype=torch.float32)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        got = train.load_checkpoint(model2, opt2, Path(d), log_fn=lambda *a: None)
        assert {k: got[k] for k in state} == state, got
        for (n1, p1), (n2, p2) in zip(model.named_parameters(), model2.named_parameters()):
            assert n1 == n2 and torch.equal(p1, p2), n1
            s1, s2 = opt.state[p1], opt2.state[p2]
            assert float(s1["step"]) == float(s2["step"]) == 2
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(s1[k], s2[k], rtol=1e-2, atol=1e-12), (n1, k)
        # the resumed optimizer steps without error
        model2(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt2.step()
    print("checkpoint: save and resume round trip (weights exact, AdamW moments to bf16, trainer state)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(train.REPO / ".train"))
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    torch.manual_seed(0)
    data = Path(args.data)
    header, arrays = train.load_shard(data / "shard.bin")
    tok = Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    passkey = train.load_passkey()
    eos = tok.token_to_id("<|im_end|>")
    batches = train.Batches(arrays, encode, passkey, "smoke")
    check_rows(batches, decode)
    cfg = train.make_config(train.TINY, header["vocab_size"], eos)
    model = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    check_losses(model, batches, torch)
    check_kernels(mq, cfg, torch)
    check_needle(batches, header["vocab_size"], encode(".")[0], torch)
    check_checkpoints(mq, header, eos, torch)
    p = train.phase_at
    assert [p(0.0), p(0.29), p(0.3), p(0.59), p(0.6), p(0.99), p(1.5)] == [0, 0, 1, 1, 2, 2, 2]
    random.seed(0)
    print("smoke test passed")


if __name__ == "__main__":
    main()
