"""The trained model's tokenizer: byte-level BPE learnt with `tokenizers`, laid out as Qwen3.5's.

NFC normaliser, Qwen3.5's split regex, GPT-2's byte mapping, the learnt merges, then Qwen3.5's added
tokens in Qwen3.5's order, so a GGUF made from it is an ordinary qwen35 file with a smaller vocabulary.
As in Qwen3.5, `<|...|>` tokens are special and the tags (`<think>`, `<tool_call>`, ...) are not.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "oracle"))
from make_oracle import QWEN35_SPLIT  # noqa: E402

EOT = "<|endoftext|>"
EOS = "<|im_end|>"
ADDED_TOKENS = (  # Qwen3.5's added tokens in id order (its ids 248044..248076)
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)


def is_special(token: str) -> bool:
    return token.startswith("<|") and token.endswith("|>")


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path, repo: Path):
    """Learn the merges from `texts`, save tokenizer.json and tokenizer_config.json (with cmpchat's
    built-in chat template) in `out_dir`, and return the `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    n_bpe = tok.get_vocab_size()
    if n_bpe != vocab_size - len(ADDED_TOKENS):
        raise SystemExit(f"the corpus gave {n_bpe} BPE tokens, wanted {vocab_size - len(ADDED_TOKENS)}")
    tok.add_tokens([AddedToken(t, special=is_special(t), normalized=False) for t in ADDED_TOKENS])
    for i, t in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(t) == n_bpe + i, t
    assert tok.get_vocab_size() == vocab_size
    save_pretrained(tok, out_dir, repo)
    return tok


def save_pretrained(tok, out_dir: Path, repo: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOT,
        clean_up_tokenization_spaces=False,
        model_max_length=262144,
    )
    fast.chat_template = (repo / "cmpchat" / "chat" / "chatml.jinja").read_text(encoding="utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
