#!/usr/bin/env python3
"""Build the training corpus from text already on this machine, train the tokenizer, write the token shard.

Sources (nothing is downloaded): Python sources and documentation under the folders given with
--source (site-packages and standard libraries of installed Pythons), text under /usr/share/doc,
English man pages rendered by groff, and chat-formatted samples made from those: a question about a
documented Python function or a command answered with its docstring or its man page's description,
in the ChatML form of cmpchat's built-in template. Documents are de-duplicated by content; one in 100
(chosen by a hash of the content) goes to the held-out split.

Output, in --out (default .train/ in the repo, which git ignores):
    tokenizer/          tokenizer.json + tokenizer_config.json (train.py and convert.py read them)
    shard.bin           the compressed token shard (format below), carried to the GPU machine
    shard.sha256        its hash
    corpus_stats.json   what went in: sources, documents, bytes and tokens by kind, unigram baseline

shard.bin is an xz stream of: 8-byte little-endian header length, a JSON header, then uint16 token
arrays one after another (the header gives each array's name and length): "train" (documents joined
by <|endoftext|>), "chat" (chat samples, each ending with <|im_end|>\\n<|endoftext|>) and "heldout".

Run it with the training venv (torch is not needed here, only tokenizers and numpy), e.g.:
    python training/corpus.py --source "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \\
        --source .venv/lib/python3.11/site-packages
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import lzma
import os
import random
import re
import subprocess
import sys
import time
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from tokenizer import EOT, train_tokenizer  # noqa: E402

CODE_SUFFIXES = {".py", ".pyi"}
DOC_SUFFIXES = {".md", ".rst", ".txt"}
MAX_FILE_BYTES = 200_000
MIN_FILE_BYTES = 200
HELDOUT_ONE_IN = 100
SEED = 26


def text_ok(text: str) -> bool:
    """Keep prose and code; drop data files, minified text and binary junk."""
    if not MIN_FILE_BYTES <= len(text) <= MAX_FILE_BYTES:
        return False
    lines = text.count("\n") + 1
    if len(text) / lines > 120:
        return False
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text[:4000])
    return printable >= 0.97 * min(len(text), 4000)


def read_text(path: Path) -> str | None:
    try:
        raw = path.read_bytes() if path.suffix != ".gz" else gzip.open(path).read(MAX_FILE_BYTES + 1)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n"))
    return text if text_ok(text) else None


def python_files(source: Path) -> list[tuple[str, Path]]:
    out = []
    for root, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "test", "tests") and not d.endswith(".dist-info"))
        for name in sorted(files):
            suffix = Path(name).suffix
            if suffix in CODE_SUFFIXES:
                out.append(("code", Path(root) / name))
            elif suffix in DOC_SUFFIXES:
                out.append(("doc", Path(root) / name))
    return out


def doc_files(source: Path) -> list[tuple[str, Path]]:
    out = []
    for root, dirs, files in os.walk(source):
        dirs.sort()
        for name in sorted(files):
            if name == "copyright" or name.endswith((".html", ".png", ".gif", ".svg", ".css", ".js")):
                continue  # licences repeat thousands of times; markup and images are no text
            if name.endswith((".md", ".txt", ".rst", ".gz")) or "." not in name:
                out.append(("doc", Path(root) / name))
    return out


def render_man(path: Path) -> str | None:
    try:
        roff = gzip.open(path).read().decode("utf-8", "replace")
        r = subprocess.run(
            ["groff", "-man", "-Tutf8", "-P", "-cbou", "-rLL=78n"],
            input=roff,
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, EOFError, gzip.BadGzipFile, subprocess.TimeoutExpired):
        return None
    text = re.sub(r"\n{3,}", "\n\n", r.stdout)
    text = unicodedata.normalize("NFC", text)
    return text if r.returncode == 0 and text_ok(text) else None


def man_description(text: str) -> tuple[str, str] | None:
    """(command, answer) from a rendered man page: its NAME line and the first DESCRIPTION paragraph."""
    name = re.search(r"^NAME\n\s+(.+?)\n\n", text, re.M | re.S)
    desc = re.search(r"^DESCRIPTION\n((?:\s+.*\n)+?)\n", text, re.M)
    if not name or not desc:
        return None
    title = " ".join(name.group(1).split())
    command = title.split(" - ")[0].split(",")[0].strip()
    body = " ".join(desc.group(1).split())
    if not command or len(body) < 40:
        return None
    return command, f"{title}.\n\n{body[:1200]}"


QUESTIONS_FUNCTION = (
    "What does `{name}` do?",
    "Explain the function `{name}` from `{module}`.",
    "How do I use `{name}`?",
    "Tell me about `{module}.{name}`.",
)
QUESTIONS_COMMAND = ("What is the `{name}` command?", "What does `{name}` do?", "Explain `{name}` briefly.")
SYSTEMS = ("", "", "You are a helpful assistant.", "Answer briefly.")


def chat_sample(rng: random.Random, question: str, answer: str) -> str:
    """One exchange in the form cmpchat's built-in template renders (thinking off)."""
    system = rng.choice(SYSTEMS)
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return (
        f"{head}<|im_start|>user\n{question}<|im_end|>\n"
        f"<|im_start|>assistant\n<think>\n\n</think>\n\n{answer.strip()}<|im_end|>\n"
    )


def docstring_pairs(text: str, module: str) -> list[tuple[str, str, str]]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and 60 <= len(doc) <= 1500:
                out.append((node.name, module, doc))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", action="append", default=[], help="a folder of Python sources and docs (repeatable)")
    ap.add_argument(
        "--doc", action="append", default=None, help="a folder of plain documentation (default /usr/share/doc)"
    )
    ap.add_argument(
        "--man", action="append", default=None, help="a man page folder (default /usr/share/man/man{1,5,8})"
    )
    ap.add_argument("--max-man-pages", type=int, default=3000)
    ap.add_argument("--train-tokens", type=int, default=40_000_000, help="most tokens in the train split")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", default=str(REPO / ".train"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    t0 = time.time()

    files: list[tuple[str, Path]] = []
    for s in args.source:
        files += python_files(Path(s))
    for s in args.doc if args.doc is not None else ["/usr/share/doc"]:
        files += doc_files(Path(s))
    print(f"{len(files)} candidate files", file=sys.stderr)

    seen: set[bytes] = set()
    docs: dict[str, list[str]] = {"code": [], "doc": [], "man": []}
    chats: list[str] = []
    pairs: list[tuple[str, str, str]] = []
    for kind, path in files:
        text = read_text(path)
        if text is None:
            continue
        h = hashlib.sha256(" ".join(text.split()).encode()).digest()
        if h in seen:
            continue
        seen.add(h)
        docs[kind].append(text)
        if kind == "code":
            pairs += docstring_pairs(text, path.stem)

    man_dirs = args.man if args.man is not None else [f"/usr/share/man/man{n}" for n in (1, 5, 8)]
    man_paths = sorted(p for d in man_dirs for p in Path(d).glob("*.gz"))
    rng.shuffle(man_paths)
    man_paths = sorted(man_paths[: args.max_man_pages])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        rendered = list(pool.map(render_man, man_paths))
    commands: list[tuple[str, str]] = []
    for text in rendered:
        if text is None:
            continue
        h = hashlib.sha256(" ".join(text.split()).encode()).digest()
        if h not in seen:
            seen.add(h)
            docs["man"].append(text)
            found = man_description(text)
            if found:
                commands.append(found)
    for name, module, doc in pairs:
        q = rng.choice(QUESTIONS_FUNCTION).format(name=name, module=module)
        chats.append(chat_sample(rng, q, doc))
    for name, answer in commands:
        chats.append(chat_sample(rng, rng.choice(QUESTIONS_COMMAND).format(name=name), answer))
    rng.shuffle(chats)
    print(
        {k: (len(v), sum(map(len, v))) for k, v in docs.items()},
        f"chat {len(chats)}",
        f"{time.time() - t0:.0f}s",
        file=sys.stderr,
    )

    # Held-out by content hash, so the split does not depend on file order.
    def heldout(text: str) -> bool:
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") % HELDOUT_ONE_IN == 0

    train_docs = [(k, t) for k, v in docs.items() for t in v if not heldout(t)]
    held_docs = [(k, t) for k, v in docs.items() for t in v if heldout(t)]
    rng.shuffle(train_docs)
    n_held_chat = len(chats) // HELDOUT_ONE_IN
    held_chats, train_chats = chats[:n_held_chat], chats[n_held_chat:]

    # The tokenizer learns from a sample of the train split (chat markers are added tokens, not merges).
    sample, size = [], 0
    for _, t in train_docs:
        sample.append(t)
        size += len(t)
        if size > 60_000_000:
            break
    tok = train_tokenizer(sample, args.vocab, out / "tokenizer", REPO)
    print(f"tokenizer trained {time.time() - t0:.0f}s", file=sys.stderr)

    eot = tok.token_to_id(EOT)

    def encode_all(texts: list[str], limit: int | None = None) -> tuple[np.ndarray, int]:
        arrays, total, used = [], 0, 0
        for start in range(0, len(texts), 2000):
            batch = texts[start : start + 2000]
            for enc in tok.encode_batch(batch, add_special_tokens=False):
                ids = enc.ids + [eot]
                arrays.append(np.asarray(ids, dtype=np.uint16))
                total += len(ids)
                used += 1
                if limit is not None and total >= limit:
                    return np.concatenate(arrays), used
        return (np.concatenate(arrays) if arrays else np.zeros(0, np.uint16)), used

    train_ids, n_train = encode_all([t for _, t in train_docs], args.train_tokens)
    kinds_used: dict[str, list[int]] = {}
    for k, t in train_docs[:n_train]:
        kinds_used.setdefault(k, [0, 0])
        kinds_used[k][0] += 1
        kinds_used[k][1] += len(t)
    chat_ids, _ = encode_all(train_chats)
    held_ids, _ = encode_all([t for _, t in held_docs] + held_chats)
    print(
        f"tokens: train {len(train_ids)}, chat {len(chat_ids)}, heldout {len(held_ids)} {time.time() - t0:.0f}s",
        file=sys.stderr,
    )

    arrays = {"train": train_ids, "chat": chat_ids, "heldout": held_ids}
    header = {
        "format": 1,
        "vocab_size": args.vocab,
        "dtype": "uint16",
        "arrays": [[name, int(a.size)] for name, a in arrays.items()],
        "eot": eot,
    }
    hb = json.dumps(header).encode()
    shard = out / "shard.bin"
    with lzma.open(shard, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for a in arrays.values():
            f.write(a.astype("<u2").tobytes())
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    (out / "shard.sha256").write_text(f"{digest}  shard.bin\n")

    counts = np.bincount(np.concatenate([train_ids, chat_ids]), minlength=args.vocab).astype(np.float64)
    p = (counts + 1) / (counts.sum() + args.vocab)
    unigram_nll = float(-np.log(p[held_ids]).mean())
    stats = {
        "sources": {
            "python_folders": len(args.source),
            "doc_folders": len(args.doc or ["/usr/share/doc"]),
            "man_pages_rendered": sum(r is not None for r in rendered),
        },
        "documents_after_dedup": {k: len(v) for k, v in docs.items()},
        "train_documents_used": {k: {"documents": v[0], "bytes": v[1]} for k, v in kinds_used.items()},
        "chat_samples": {
            "train": len(train_chats),
            "heldout": len(held_chats),
            "from_docstrings": len(pairs),
            "from_man_pages": len(commands),
        },
        "heldout_documents": len(held_docs),
        "tokens": {name: int(a.size) for name, a in arrays.items()},
        "unigram_heldout_nll": unigram_nll,
        "unigram_heldout_ppl": float(np.exp(unigram_nll)),
        "shard_bytes": shard.stat().st_size,
        "shard_sha256": digest,
    }
    (out / "corpus_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
