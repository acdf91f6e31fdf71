"""Byte-level tokenizer: token = byte value, vocabulary 256. Lossless for any text."""

import numpy as np


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, tokens) -> str:
        return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")
