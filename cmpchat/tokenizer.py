"""Text ↔ token ids for Qwen3.5/3.6 model files: GGUF `gpt2` byte-level BPE, `qwen35` pre-tokenizer.

Encoding follows the model's own tokenizer: NFC-normalise the text, split off special tokens
(CONTROL and USER_DEFINED entries of the vocabulary, matched whole), cut the rest into pre-tokens
with the `qwen35` regex and run byte-level BPE on each (Hugging Face `tokenizers` does the last two
steps). Decoding maps every id to its bytes and decodes UTF-8 once, so a streamed decode and a
one-shot decode agree.
"""

from __future__ import annotations

import codecs
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import gguf
import tokenizers
from tokenizers import models, pre_tokenizers

from cmpchat.errors import CmpchatError

PRE_TOKENIZER_PATTERNS: Mapping[str, str] = {
    # digits split one by one; \p{M} keeps combining marks with their letters
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
"""Pre-tokenizer regex for each supported `tokenizer.ggml.pre` value."""

STOP_TOKENS = ("<|endoftext|>", "<|im_end|>")
"""Tokens that end generation besides the file's EOS token, when the vocabulary has them."""

_SPECIAL_TYPES = frozenset({int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)})
_UNUSED_TYPE = int(gguf.TokenType.UNUSED)
_SURROGATE = re.compile("[\ud800-\udfff]")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → character map: printable Latin-1 bytes stand for themselves, the rest
    (control bytes, space, NBSP, soft hyphen) move to U+0100 upwards, so every token is printable."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


class Tokenizer:
    """Encodes text to token ids and decodes ids back, as the model's own tokenizer does."""

    def __init__(
        self,
        *,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        pre: str = "qwen35",
        eos_token_id: int | None = None,
    ) -> None:
        """Build from a `gpt2` vocabulary; `pre` names the pre-tokenizer regex (see `from_metadata`)."""
        if pre not in PRE_TOKENIZER_PATTERNS:
            raise CmpchatError(
                f"pre-tokenizer {pre!r} is not supported: cmpchat reads Qwen3.5/3.6 GGUF files "
                f"(tokenizer.ggml.pre = {' or '.join(PRE_TOKENIZER_PATTERNS)})"
            )
        if len(tokens) != len(token_types):
            raise _broken(f"{len(tokens)} tokens but {len(token_types)} token types")
        if eos_token_id is not None and not 0 <= eos_token_id < len(tokens):
            raise _broken(f"EOS token id {eos_token_id} is outside the vocabulary")
        self._pieces = list(tokens)
        self._piece_to_id = {piece: token_id for token_id, piece in enumerate(self._pieces)}
        self._special_ids = frozenset(i for i, kind in enumerate(token_types) if kind in _SPECIAL_TYPES)
        self._token_bytes = _token_bytes_table(self._pieces, token_types)
        self._engine = _bpe_engine(self._pieces, token_types, merges, PRE_TOKENIZER_PATTERNS[pre])
        self._special_pattern = _special_token_pattern(self._pieces[i] for i in self._special_ids)

        eos_ids = set() if eos_token_id is None else {eos_token_id}
        eos_ids.update(self._piece_to_id[t] for t in STOP_TOKENS if t in self._piece_to_id)
        self._eos_token_ids = frozenset(eos_ids)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key → plain Python value); unsupported tokenizers raise
        `CmpchatError`."""
        keys = gguf.Keys.Tokenizer
        model = metadata.get(keys.MODEL)
        if model is None:
            raise CmpchatError(
                "the model file has no tokenizer (tokenizer.ggml.model is missing): use a complete "
                "Qwen3.5/3.6 GGUF file"
            )
        if model != "gpt2":
            raise CmpchatError(
                f"tokenizer {model!r} is not supported: cmpchat reads gpt2 BPE tokenizers (Qwen3.5/3.6 GGUF files)"
            )
        missing = [key for key in (keys.LIST, keys.TOKEN_TYPE, keys.MERGES) if key not in metadata]
        if missing:
            raise CmpchatError(f"the model file's tokenizer is incomplete: {', '.join(missing)} missing")
        return cls(
            tokens=metadata[keys.LIST],
            token_types=metadata[keys.TOKEN_TYPE],
            merges=metadata[keys.MERGES],
            pre=metadata.get(keys.PRE, "default"),
            eos_token_id=metadata.get(keys.EOS_ID),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, padding ids included."""
        return len(self._pieces)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the file's EOS token plus `<|endoftext|>` and `<|im_end|>`."""
        return self._eos_token_ids

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special token (CONTROL or USER_DEFINED)."""
        return token_id in self._special_ids

    def token_to_id(self, piece: str) -> int | None:
        """Id of a vocabulary entry as stored (GPT-2 byte form, e.g. "Ġthe"), or None."""
        return self._piece_to_id.get(piece)

    def id_to_piece(self, token_id: int) -> str:
        """Vocabulary entry of `token_id` as stored (GPT-2 byte form; specials as plain text)."""
        return self._pieces[_checked_id(token_id, len(self._pieces))]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes `token_id` stands for (empty for padding ids)."""
        return self._token_bytes[_checked_id(token_id, len(self._pieces))]

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text` (no BOS is ever added).

        With `parse_special=False`, special-token text is encoded as ordinary text; use it for
        anything a user typed, so it cannot inject control tokens. Lone UTF-16 surrogates (valid
        in JSON and in a Python str, but not Unicode text) are read as U+FFFD, and a surrogate
        pair as the character it encodes, as a browser reads the same string.
        """
        text = without_surrogates(text)
        # NFC here rather than as a `tokenizers` normaliser: it must run before special tokens are
        # matched, as in the reference tokenizer (NFC turns ">" + U+0338 into "≯")
        text = unicodedata.normalize("NFC", text)
        if not parse_special or self._special_pattern is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            ids += self._encode_ordinary(text[start : match.start()])
            ids.append(self._piece_to_id[match.group()])
            start = match.end()
        ids += self._encode_ordinary(text[start:])
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens included; invalid UTF-8 becomes U+FFFD."""
        table = self._token_bytes
        ids = list(ids)
        if ids and min(ids) < 0:
            raise IndexError(f"token id {min(ids)} is negative")
        return b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        """A decoder that turns ids into text one at a time (see `StreamDecoder`)."""
        return StreamDecoder(self._token_bytes)

    def _encode_ordinary(self, text: str) -> list[int]:
        if not text:
            return []
        return self._engine.encode(text, add_special_tokens=False).ids


class StreamDecoder:
    """Incremental decoding of generated ids: `feed` returns only complete UTF-8 text.

    A character split across tokens (an emoji spread over byte tokens) comes out with the token
    that completes it; `flush` ends the stream and turns an incomplete tail into U+FFFD. The
    concatenated output equals `Tokenizer.decode` of all ids.
    """

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        """Decode with `token_bytes[id]` as the bytes of each id."""
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        return self._utf8.decode(self._token_bytes[_checked_id(token_id, len(self._token_bytes))])

    def flush(self) -> str:
        """End the stream: return what is held back (U+FFFD for a broken tail) and reset."""
        return self._utf8.decode(b"", final=True)


def without_surrogates(text: str) -> str:
    """`text` as Unicode, as `Tokenizer.encode` reads it: a lone UTF-16 surrogate becomes U+FFFD, a surrogate pair
    the character it encodes."""
    if _SURROGATE.search(text) is None:
        return text
    # Through UTF-16, where surrogates are what they were made for: pairs join, the rest become U+FFFD.
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _broken(detail: str) -> CmpchatError:
    return CmpchatError(f"the model file's tokenizer is broken: {' '.join(detail.split())}")


def _checked_id(token_id: int, vocab_size: int) -> int:
    # negative ids would silently index from the end of the tables
    if not 0 <= token_id < vocab_size:
        raise IndexError(f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")
    return token_id


def _token_bytes_table(pieces: Sequence[str], token_types: Sequence[int]) -> list[bytes]:
    """The bytes of every id: byte-level pieces mapped back through GPT-2's byte map, special
    tokens as their UTF-8 text, padding ids empty."""
    to_latin1 = str.maketrans({char: chr(b) for b, char in bytes_to_unicode().items()})
    table = []
    for piece, kind in zip(pieces, token_types):
        if kind in _SPECIAL_TYPES:
            table.append(piece.encode("utf-8"))
        elif kind == _UNUSED_TYPE:
            table.append(b"")
        else:
            try:
                table.append(piece.translate(to_latin1).encode("latin-1"))
            except UnicodeEncodeError:
                # not byte-level text: the entry stands for itself
                table.append(piece.encode("utf-8"))
    return table


def _bpe_engine(
    pieces: Sequence[str], token_types: Sequence[int], merges: Sequence[str], pattern: str
) -> tokenizers.Tokenizer:
    """A Hugging Face tokenizer for ordinary text: regex split, byte-level map, BPE (no specials)."""
    vocab = {
        piece: token_id
        for token_id, (piece, kind) in enumerate(zip(pieces, token_types))
        if kind not in _SPECIAL_TYPES and kind != _UNUSED_TYPE
    }
    try:
        merge_pairs = [(left, right) for left, _, right in (merge.partition(" ") for merge in merges)]
        # ignore_merges: a pre-token that is itself a vocabulary entry becomes that token, as in
        # tiktoken; a few Qwen tokens cannot be reached through merges otherwise
        model = models.BPE(vocab=vocab, merges=merge_pairs, ignore_merges=True)
    except Exception as err:
        raise _broken(str(err)) from err
    engine = tokenizers.Tokenizer(model)
    engine.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return engine


def _special_token_pattern(specials: Iterable[str]) -> re.Pattern[str] | None:
    """A regex matching any special token whole, longest first; None when there are none."""
    texts = sorted({text for text in specials if text}, key=len, reverse=True)
    if not texts:
        return None
    return re.compile("|".join(map(re.escape, texts)))
