"""Tokenizers for `tpud prepare`: a Hugging Face tokenizer.json, a BPE trained on the inputs, or bytes.

`--tokenizer` takes a tokenizer.json file or a directory holding one (Llama 3, Mistral, Qwen
and most models ship it), `train:VOCAB_SIZE`, or `bytes`. Every document is encoded without
the tokenizer's own template and framed here: [BOS] tokens EOS, BOS only where the tokenizer
defines one, so a template that already adds BOS never doubles it. Which tokens are BOS and
end-of-text comes from tokenizer_config.json beside the file when there is one, else from the
well-known names below. Torch-free; instances pickle (workers get the JSON, not the object).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.files import Refused, read_regular_file

EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>")
TRAINED_EOS = "<|endoftext|>"
# A Hugging Face encoding costs about 300 bytes of memory a token (its offsets, tokens and masks),
# so a document longer than this is encoded a piece at a time: a 16 MiB document encoded whole
# peaks at 2 GB. Pieces are cut before whitespace, where pre-tokenizers split anyway.
PIECE_CHARS = 1 << 20


class TokenizerError(ValueError):
    """A --tokenizer value that names no usable tokenizer."""


@dataclass
class Tokenizer:
    kind: str  # "bytes" or "huggingface"
    vocab_size: int
    eos_id: int
    bos_id: int | None
    json: str | None = None  # tokenizer.json's text (huggingface)
    _hf: object = field(default=None, repr=False, compare=False)
    _specials: np.ndarray | None = field(default=None, repr=False, compare=False)  # ids of special added tokens

    @property
    def sha256(self) -> str:
        return hashlib.sha256((self.json or "bytes").encode()).hexdigest()

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_hf": None, "_specials": None}

    def _backend(self):
        if self._hf is None:
            from tokenizers import Tokenizer as HfTokenizer

            self._hf = HfTokenizer.from_str(self.json)
        return self._hf

    def encode_batch(self, texts: list[str], piece_chars: int = PIECE_CHARS) -> tuple[np.ndarray, np.ndarray]:
        """The documents' framed ids, concatenated (uint32), and each document's framed length."""
        seqs = self._contents(texts, piece_chars)
        lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
        content = np.concatenate(seqs, dtype=np.uint32) if seqs else np.empty(0, np.uint32)
        head = 0 if self.bos_id is None else 1
        framed = lengths + head + 1
        ends = np.cumsum(framed)
        out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.uint32)
        # Content token j of document k moves past k documents' framing and its own BOS.
        out[np.arange(len(content)) + np.repeat(np.arange(len(seqs)) * (head + 1) + head, lengths)] = content
        out[ends - 1] = self.eos_id
        if head:
            out[ends - framed] = self.bos_id
        return out, framed

    def _contents(self, texts: list[str], piece_chars: int) -> list[np.ndarray]:
        """Each document's ids, unframed; short documents in one batch, long ones a piece at a time."""
        if self.kind == "bytes":
            return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]
        hf = self._backend()
        short = [i for i, text in enumerate(texts) if len(text) <= piece_chars]
        seqs: list[np.ndarray | None] = [None] * len(texts)
        for i, encoding in zip(short, hf.encode_batch_fast([texts[i] for i in short], add_special_tokens=False)):
            seqs[i] = np.asarray(encoding.ids, dtype=np.uint32)
        for i, text in enumerate(texts):
            if seqs[i] is None:
                seqs[i] = np.concatenate([np.asarray(hf.encode(piece, add_special_tokens=False).ids, dtype=np.uint32)
                                          for piece in pieces(text, piece_chars)])
        return seqs

    def encode_masked(self, text: str, spans: list[tuple[int, int]], turns: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """A rendered conversation's ids, led by exactly one BOS where the tokenizer has one (a
        template that renders it keeps its own), and its loss mask (uint8): 1 for each token that
        starts inside a character span [start, end); with `turns` (each span one turn), a span
        ends after its first special token (the end of the turn: what follows it, such as a
        newline, is the template's). The first token is never a target: nothing precedes it."""
        if self.kind == "bytes":
            data = text.encode("utf-8")
            ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint32)
            starts = np.arange(len(ids))
            spans = [(len(text[:s].encode("utf-8")), len(text[:e].encode("utf-8"))) for s, e in spans]
            special = np.zeros(len(ids), dtype=bool)
        else:
            hf = self._backend()
            encoding = hf.encode(text, add_special_tokens=False)
            ids = np.asarray(encoding.ids, dtype=np.uint32)
            starts = np.fromiter((start for start, _ in encoding.offsets), dtype=np.int64, count=len(ids))
            if self._specials is None:
                self._specials = np.asarray([i for i, t in hf.get_added_tokens_decoder().items() if t.special],
                                            dtype=np.uint32)
            special = np.isin(ids, self._specials)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for start, end in spans:
            inside = np.flatnonzero((starts >= start) & (starts < end))
            ends_turn = np.flatnonzero(special[inside]) if turns else ()
            mask[inside[:ends_turn[0] + 1] if len(ends_turn) else inside] = 1
        if self.bos_id is not None and (len(ids) == 0 or ids[0] != self.bos_id):
            ids, mask = np.concatenate([[self.bos_id], ids]).astype(np.uint32), np.concatenate([[0], mask]).astype(np.uint8)
        if len(mask):
            mask[0] = 0
        return ids, mask

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "bytes":
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._backend().decode(ids, skip_special_tokens=True)


def pieces(text: str, size: int) -> Iterable[str]:
    """`text` in pieces of at most `size` characters, each cut before a whitespace character in its
    second half where there is one."""
    start = 0
    while len(text) - start > size:
        end = start + size
        cut = max(text.rfind("\n", start + size // 2, end), text.rfind(" ", start + size // 2, end))
        cut = end if cut <= start else cut
        yield text[start:cut]
        start = cut
    yield text[start:]


def byte_tokenizer() -> Tokenizer:
    """Token = byte value; 256 is end-of-text. Lossless for any text."""
    return Tokenizer("bytes", vocab_size=257, eos_id=256, bos_id=None)


def load(spec: str) -> Tokenizer:
    """A tokenizer.json file or a directory with one (its tokenizer_config.json names BOS and EOS)."""
    path = Path(spec)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(f"{spec}: no tokenizer.json there (give a tokenizer.json, a directory holding one, "
                             f"train:VOCAB_SIZE or bytes)")
    try:
        text = file.read_text()
        from tokenizers import Tokenizer as HfTokenizer

        hf = HfTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise TokenizerError(f"{file}: not a Hugging Face tokenizer.json: {e}") from None
    config = _config(file.parent / "tokenizer_config.json")
    eos = _special(hf, config.get("eos_token"), EOS_NAMES)
    if eos is None:
        raise TokenizerError(f"{file}: no end-of-text token found (looked for {', '.join(EOS_NAMES)}; "
                             f"name it as eos_token in tokenizer_config.json beside the file)")
    bos = _special(hf, config.get("bos_token"), BOS_NAMES) if "bos_token" not in config or config["bos_token"] else None
    return Tokenizer("huggingface", hf.get_vocab_size(with_added_tokens=True), eos, bos, text, hf)


def _config(path: Path) -> dict:
    """tokenizer_config.json, or {} when absent or unreadable (bounded, and never a FIFO's blocking read)."""
    try:
        config = json.loads(read_regular_file(path, limit=16 << 20))
    except (OSError, ValueError, Refused):
        return {}
    return config if isinstance(config, dict) else {}


def _special(hf, configured: object, names: tuple[str, ...]) -> int | None:
    if isinstance(configured, dict):  # the AddedToken form: {"content": "<s>", ...}
        configured = configured.get("content")
    for name in ((configured,) if isinstance(configured, str) else names):
        token_id = hf.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def train(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style) trained on `texts`; end-of-text is <|endoftext|>."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise TokenizerError(f"train:{vocab_size}: a byte-level BPE needs a vocabulary of at least "
                             f"{len(alphabet) + 1} (256 bytes and end-of-text)")
    hf = HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[TRAINED_EOS], initial_alphabet=alphabet, show_progress=False))
    return Tokenizer("huggingface", hf.get_vocab_size(with_added_tokens=True), hf.token_to_id(TRAINED_EOS), None,
                     hf.to_str(), hf)


def parse_spec(spec: str) -> int | None:
    """The vocabulary size of a train:N spec, None for other specs."""
    if not spec.startswith("train:"):
        return None
    try:
        size = int(spec.removeprefix("train:"))
    except ValueError:
        raise TokenizerError(f"{spec}: expected train:VOCAB_SIZE, e.g. train:8192") from None
    if size < 1:
        raise TokenizerError(f"{spec}: the vocabulary size must be positive")
    return size
