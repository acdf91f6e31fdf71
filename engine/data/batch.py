"""A micro-batch as the model takes it: inputs, targets, and with document masking the segment
ids and RoPE positions of each token.

Made on the host from windows of seq_len + 1 tokens (engine.data.loader). A target the loss
must leave out is IGNORE, which every loss honours (engine.losses): the prediction from one
document's last token to the next one's first, and the targets a loss mask drops (the prompts
of chat data), so a new reason to ignore a target changes this module only (`kept`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

IGNORE = -100  # the losses' ignore_index


@dataclass(frozen=True, eq=False)
class Batch:
    inputs: torch.Tensor  # int64 [B, T]
    targets: torch.Tensor  # int64 [B, T], IGNORE where no loss is taken
    # With document masking, int32 [B, T]: each token's document in its window, and its position
    # in that document (the first document of a window counts from the window's start).
    segments: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    # With an offline teacher (engine.distill.offline), [B, T, k]: its likeliest next tokens at
    # each input (int32) and their log-probabilities (float32).
    teacher_ids: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None

    @classmethod
    def of(cls, rows: np.ndarray, segments: np.ndarray | None = None, masks: np.ndarray | None = None,
           teacher: tuple[np.ndarray, np.ndarray] | None = None) -> Batch:
        """From windows [B, T + 1] of tokens and, when documents are masked, their segment ids;
        masks: the windows' loss masks (1: a trained target), when the data has them; teacher: an
        offline teacher's top k (ids, log-probabilities [B, T, k])."""
        rows = rows.astype(np.int64)
        tokens = torch.from_numpy(rows)
        keep = kept(segments, masks)
        targets = tokens[:, 1:] if keep is None else torch.from_numpy(np.where(keep, rows[:, 1:], IGNORE))
        top = {} if teacher is None else {"teacher_ids": torch.from_numpy(np.ascontiguousarray(teacher[0])),
                                          "teacher_logp": torch.from_numpy(np.ascontiguousarray(teacher[1]))}
        if segments is None:
            return cls(tokens[:, :-1], targets, **top)
        segments = np.ascontiguousarray(segments[:, :-1], dtype=np.int32)  # the inputs'
        index = np.arange(segments.shape[1], dtype=np.int32)
        starts = np.where(np.diff(segments, axis=1, prepend=segments[:, :1]) != 0, index, 0)
        positions = index - np.maximum.accumulate(starts, axis=1)
        return cls(tokens[:, :-1], targets, torch.from_numpy(segments), torch.from_numpy(positions), **top)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """fn applied to each tensor (pinning, sending to the device)."""
        return replace(self, **{f.name: fn(value) for f in fields(self)
                                if (value := getattr(self, f.name)) is not None})

    def __eq__(self, other: object) -> bool:
        """The same batch: every tensor equal, element for element."""
        if not isinstance(other, Batch):
            return NotImplemented
        pairs = [(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)]
        return all(a is b if a is None or b is None else torch.equal(a, b) for a, b in pairs)

    @classmethod
    def cat(cls, batches: list[Batch]) -> Batch:
        """One batch of the sequences of several (ranks' slices of a global batch), in order."""
        return cls(**{f.name: None if (values := [getattr(b, f.name) for b in batches])[0] is None
                      else torch.cat(values) for f in fields(cls)})


def kept(segments: np.ndarray | None, masks: np.ndarray | None) -> np.ndarray | None:
    """bool [B, T]: which targets of windows [B, T + 1] the loss takes; None for all of them."""
    keep = None
    if segments is not None:
        keep = segments[:, 1:] == segments[:, :-1]  # not the next document's first token
    if masks is not None:
        keep = masks[:, 1:].astype(bool) if keep is None else keep & masks[:, 1:].astype(bool)
    return keep
