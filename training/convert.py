#!/usr/bin/env python3
"""Convert the trained checkpoint to GGUF with llama.cpp's converter and record transformers' logits.

Reads train.py's output (--checkpoint: safetensors shards, config.json, summary.json) and corpus.py's
tokenizer (--data), then writes:

  in --out (tests/fixtures/trained, committed):
    trained.q8_0.gguf   the model as `convert_hf_to_gguf.py --outtype q8_0` writes it
    trained.npz         for each prompt P: ids_P (int32 [T]), pos_P (int32: the positions kept) and
                        logits_q8_0_P (float32 [len(pos_P), vocab]): transformers' full causal forward
                        (fp32, no cache) with every matrix replaced by its dequantised Q8_0 value
    manifest.json       versions, sizes and hashes, config, prompts, tokenizer cases (texts and
                        transformers' ids), logit statistics, the training summary
  in --work (default .train/convert, not committed):
    hf/                 the checkpoint as a transformers folder (with the tokenizer and chat template)
    trained.f16.gguf    --outtype f16;  trained.f32.gguf: --outtype f32 (for the layout check)
    trained_f16.npz     ids_P and logits_f16_P (all positions): the oracle for the F16 file

The converter runs as make_oracle.py runs it (a child process, `get_vocab_base_pre` patched to
"qwen35" since the home-made tokenizer has no known hash, --no-mtp). make_oracle's layout check
(value-head re-tiling, -exp(A_log), +1 on the zero-centred norms, conv layout) runs on the F32 file.
Run with the training venv:

    python training/convert.py --checkpoint CKPT --llama-cpp ~/lcp/llama_cpp_python-0.3.36
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import sys
import unicodedata
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "oracle"))
import make_oracle  # noqa: E402

PROMPTS = {  # written for this repository; short so the committed logits stay small
    "prose": "The keeper of the old lighthouse wrote the weather into a small book every evening, and then he",
    "chat": (
        "<|im_start|>user\nWhat does `json.dumps` do?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nSerialize"
    ),
    "code": 'def read_config(path):\n    """Return the settings stored in the file at path."""\n    with open(',
}
PASSKEY_PROMPT = {"name": "passkey", "length": 600, "depth": 0.3, "key": "73914"}
KEEP_LAST = 8  # positions of the long prompt whose logits are stored
TOKENIZER_CASES = [
    "Hello, world!",
    "def f(x):\n    return x * 2  # twice\n",
    "Numbers 2024, 3.14 and 1000000 split digit by digit.",
    "Café, naïve, 東京 and 🙂 — NFC: Cafe\u0301.",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call><|endoftext|>",
    "<|vision_start|><|image_pad|><|vision_end|> <tool_response>ok</tool_response>",
    "   leading spaces, tabs\tand\r\nnewlines\n\n\n",
]
MODEL_NAME = "cmpchat-trained-qwen35-8m"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_passkey():
    import importlib.util

    spec = importlib.util.spec_from_file_location("passkey", REPO / "cmpchat" / "evaluation" / "passkey.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_hf_dir(checkpoint: Path, tokenizer: Path, hf: Path) -> None:
    if hf.exists():
        shutil.rmtree(hf)
    hf.mkdir(parents=True)
    shards = sorted(checkpoint.glob("model-*.safetensors"))
    if not shards:
        raise SystemExit(f"no model-*.safetensors in {checkpoint}")
    from safetensors import safe_open

    weight_map, total = {}, 0
    for s in shards:
        shutil.copy(s, hf / s.name)
        with safe_open(str(s), "np") as f:
            for k in f.keys():
                weight_map[k] = s.name
                total += f.get_tensor(k).nbytes
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n"
    )
    cj = json.loads((checkpoint / "config.json").read_text())
    # Released configs carry full_attention_interval beside layer_types; the converter reads it.
    cj["full_attention_interval"] = 4
    (hf / "config.json").write_text(json.dumps(cj, indent=2) + "\n")
    for f in tokenizer.iterdir():
        shutil.copy(f, hf / f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="train.py's output folder")
    ap.add_argument("--data", default=str(REPO / ".train"), help="corpus.py's output folder (for the tokenizer)")
    ap.add_argument("--llama-cpp", required=True, help="unpacked llama-cpp-python 0.3.36 sdist")
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "trained"))
    ap.add_argument("--work", default=str(REPO / ".train" / "convert"))
    args = ap.parse_args()

    import numpy as np
    import tokenizers
    import torch
    import transformers
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    llama = make_oracle.find_llama_cpp(args.llama_cpp)
    sys.path.insert(0, str(llama / "gguf-py"))  # make_oracle's helpers import that tree's own gguf

    checkpoint, out, work = Path(args.checkpoint), Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    hf = work / "hf"
    make_hf_dir(checkpoint, Path(args.data) / "tokenizer", hf)
    torch.set_num_threads(2)

    tok = AutoTokenizer.from_pretrained(hf)
    model = Qwen3_5ForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    files = {"f32": work / "trained.f32.gguf", "f16": work / "trained.f16.gguf", "q8_0": out / "trained.q8_0.gguf"}
    for outtype, path in files.items():
        make_oracle.run_converter(llama, hf, path, outtype, MODEL_NAME)
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    make_oracle.check_layout(hf, files["f32"], {}, cfg)

    passkey = load_passkey()

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    prompts = {}
    for name, text in PROMPTS.items():
        ids = encode(text)
        if tok.decode(ids) != unicodedata.normalize("NFC", text):
            raise SystemExit(f"prompt {name} does not round-trip through the tokenizer")
        prompts[name] = {"text": text, "ids": ids, "positions": list(range(len(ids)))}
    pk = PASSKEY_PROMPT
    ids = passkey.build_prompt(encode, pk["length"], pk["depth"], pk["key"])
    prompts[pk["name"]] = {**pk, "ids": ids, "positions": list(range(len(ids) - KEEP_LAST, len(ids)))}

    def forward_all() -> dict[str, np.ndarray]:
        with torch.no_grad():
            return {
                n: model(input_ids=torch.tensor([p["ids"]]), use_cache=False).logits[0].float().numpy()
                for n, p in prompts.items()
            }

    f32_logits = forward_all()
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    oracles, stats = {}, {}
    for outtype in ("f16", "q8_0"):
        weights, types = make_oracle.hf_matrices_from_gguf(files[outtype], cfg)
        for name, t in types.items():
            is_matrix = name == "token_embd.weight" or name.split(".", 2)[-1] in make_oracle.GGUF_TO_HF_MATRIX
            if t != (outtype.upper() if is_matrix else "F32"):
                raise SystemExit(f"unexpected type {t} for {name} in {files[outtype].name}")
        with torch.no_grad():
            model.load_state_dict(original)
            for k, v in weights.items():
                model.get_parameter(k).copy_(torch.from_numpy(v))
        oracles[outtype] = forward_all()
    with torch.no_grad():
        model.load_state_dict(original)

    arrays, f16_arrays = {}, {}
    for n, p in prompts.items():
        pos = np.asarray(p["positions"], dtype=np.int32)
        arrays[f"ids_{n}"] = np.asarray(p["ids"], dtype=np.int32)
        arrays[f"pos_{n}"] = pos
        arrays[f"logits_q8_0_{n}"] = oracles["q8_0"][n][pos].astype(np.float32)
        f16_arrays[f"ids_{n}"] = arrays[f"ids_{n}"]
        f16_arrays[f"logits_f16_{n}"] = oracles["f16"][n].astype(np.float32)
        f32 = f32_logits[n]
        stats[n] = {
            "n_tokens": len(p["ids"]),
            "max_abs_logit": float(np.abs(f32).max()),
            "std_logit": float(f32.std()),
            "f16_oracle_vs_f32_max_abs_diff": float(np.abs(oracles["f16"][n] - f32).max()),
            "q8_0_oracle_vs_f32_max_abs_diff": float(np.abs(oracles["q8_0"][n] - f32).max()),
            "greedy_next": tok.decode([int(f32[-1].argmax())]),
        }
    np.savez_compressed(out / "trained.npz", **arrays)
    np.savez_compressed(work / "trained_f16.npz", **f16_arrays)

    fast = tok.backend_tokenizer if hasattr(tok, "backend_tokenizer") else tok._tokenizer
    cases = []
    for text in TOKENIZER_CASES:
        ids = fast.encode(text, add_special_tokens=False).ids
        cases.append({"text": text, "ids": ids, "decoded": fast.decode(ids, skip_special_tokens=False)})
    added = {t.content: i for i, t in sorted(tok.added_tokens_decoder.items())}
    summary = json.loads((checkpoint / "summary.json").read_text()) if (checkpoint / "summary.json").is_file() else {}
    manifest = {
        "format": 1,
        "about": "A small Qwen3.5 trained with transformers (training/train.py), converted by llama.cpp's "
        "converter; see README.md (the model card).",
        "generator": "training/convert.py",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
            "llama_cpp_python_sdist": "0.3.36" if "0.3.36" in str(llama) else llama.name,
            "gguf_py": make_oracle._gguf_py_version(llama),
        },
        "files": {
            k: {"path": p.name, "committed": p.parent == out, "bytes": p.stat().st_size, "sha256": sha256(p)}
            for k, p in files.items()
        },
        "npz_layout": "ids_<prompt>: int32 [T]; pos_<prompt>: int32, the positions kept; logits_q8_0_<prompt>: "
        "float32 [len(pos), vocab], transformers (fp32, full causal forward, no cache) on the "
        "dequantised Q8_0 matrices, row i predicting the token after position pos[i]",
        "config": {
            k: v
            for k, v in cfg.to_dict().items()
            if (not isinstance(v, dict) or k == "rope_parameters") and k != "_name_or_path"  # a local path
        },
        "vocab_size": cfg.vocab_size,
        "added_tokens": added,
        "eos": "<|im_end|>",
        "prompts": prompts,
        "tokenizer_cases": cases,
        "logits": stats,
        "training": summary,
        "corpus": json.loads((Path(args.data) / "corpus_stats.json").read_text()),
        "gguf": {k: make_oracle.gguf_summary(p) for k, p in files.items() if k == "q8_0"},
    }
    manifest["gguf"]["q8_0"]["metadata"].pop("tokenizer.ggml.merges", None)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(stats, indent=1))
    print(f"wrote {out / 'manifest.json'}")


if __name__ == "__main__":
    main()
