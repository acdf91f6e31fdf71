"""Conversations as trained tokens, packed whole into windows (`tpud prepare --format chat`).

A job cuts a split's token stream into windows of data.seq_len + 1 tokens. Text documents
may straddle windows; a conversation must not, or a window would hold an answer without its
question. So conversations are packed here, at prepare time, into windows of exactly that
size, first-fit among a bounded set of open windows (memory stays bounded on any dataset),
and what is left of a window is one padding document that no loss is taken on. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from engine.prepare import chat
from engine.prepare import tokenizer as tk

OPEN_WINDOWS = 64  # windows filled at once; past this the fullest is written
# A token of any published tokenizer spans far fewer characters than this: a rendered
# conversation longer than this many characters per window token cannot fit, so it is not
# tokenized at all (a 64 MiB record would otherwise cost gigabytes of encoding).
MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class Encoded:
    """A chunk of conversations as tokens: concatenated ids and masks, each one's length (0 when it
    was dropped), and what happened to the others: (index, kind, reason), kind error, dropped or
    truncated."""

    ids: np.ndarray
    masks: np.ndarray
    lengths: np.ndarray
    notes: list[tuple[int, str, str]]


@dataclass(frozen=True)
class ConversationEncoder:
    """What a tokenizer process needs to turn conversations (as JSON message lists) into tokens."""

    template: chat.Template
    train_on: str
    window: int
    overlong: str

    def encode(self, tokenizer: tk.Tokenizer, texts: list[str]) -> Encoded:
        ids, masks, lengths, notes = [], [], np.zeros(len(texts), dtype=np.int64), []
        for i, text in enumerate(texts):
            try:
                rendered, spans = chat.trained_spans(self.template, json.loads(text), self.train_on,
                                                     MAX_CHARS_PER_TOKEN * self.window)
            except chat.ChatError as e:
                notes.append((i, "error", str(e)))
                continue
            if len(rendered) > MAX_CHARS_PER_TOKEN * self.window:
                if self.overlong == "drop":
                    notes.append((i, "dropped", f"{len(rendered)} characters: longer than a window"))
                    continue
                rendered = rendered[:MAX_CHARS_PER_TOKEN * self.window]
            tokens, mask = tokenizer.encode_masked(rendered, spans, turns=self.train_on != "all")
            if len(tokens) > self.window:
                if self.overlong == "drop":
                    notes.append((i, "dropped", f"{len(tokens)} tokens: longer than a window of {self.window}"))
                    continue
                tokens, mask = tokens[:self.window], mask[:self.window]
                notes.append((i, "truncated", f"{len(tokens)} tokens kept"))
            if not mask.any():
                notes.append((i, "dropped", "no trained token left"))
                continue
            ids.append(tokens)
            masks.append(mask)
            lengths[i] = len(tokens)
        return Encoded(np.concatenate(ids) if ids else np.empty(0, np.uint32),
                       np.concatenate(masks) if masks else np.empty(0, np.uint8), lengths, notes)


class Packer:
    """Whole conversations into windows of `window` tokens, first fit; each full window is
    returned as (ids, masks, document lengths), its padding the last document."""

    def __init__(self, window: int, pad_id: int, open_windows: int = OPEN_WINDOWS):
        self.window, self.pad_id, self.limit = window, pad_id, open_windows
        self.open: list[list[tuple[np.ndarray, np.ndarray]]] = []
        self.used: list[int] = []
        self.padding = self.conversations = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        if not 0 < len(ids) <= self.window:
            raise ValueError(f"a conversation of {len(ids)} tokens does not fit a window of {self.window}")
        self.conversations += 1
        fits = next((i for i, used in enumerate(self.used) if used + len(ids) <= self.window), None)
        if fits is None:
            self.open.append([])
            self.used.append(0)
            fits = len(self.open) - 1
        self.open[fits].append((ids, mask))
        self.used[fits] += len(ids)
        if self.used[fits] == self.window:
            return [self._close(fits)]
        if len(self.open) > self.limit:
            return [self._close(int(np.argmax(self.used)))]
        return []

    def finish(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return [self._close(0) for _ in range(len(self.open))]

    def _close(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts, used = self.open.pop(i), self.used.pop(i)
        lengths = [len(ids) for ids, _ in parts]
        pad = self.window - used
        if pad:
            parts.append((np.full(pad, self.pad_id, dtype=np.uint32), np.zeros(pad, dtype=np.uint8)))
            lengths.append(pad)
            self.padding += pad
        return (np.concatenate([ids for ids, _ in parts]).astype(np.uint32),
                np.concatenate([mask for _, mask in parts]).astype(np.uint8), np.asarray(lengths, dtype=np.int64))
