"""Validation loss: the held-out split's fixed micro-batches, forward only.

Every evaluation reads the same `eval.batches` micro-batches (the validation split in order,
each rank its slice of each), so the values of one run compare with each other and with a
resumed run's. The loss is the sum over every target of those micro-batches, across every rank,
divided by their number (masked targets left out, as in training); the time counts as its own
badput kind.
"""

from __future__ import annotations

import math
import time

import structlog
import torch
from torch import nn

from engine import events
from engine.backends.base import Backend
from engine.badput import Badput
from engine.data.dataset import Samples
from engine.data.loader import PackedLoader
from engine.checkpoint.checkpointer import Emit
from engine.spec.schema import EvalConfig

log = structlog.get_logger()


class Evaluator:
    def __init__(self, cfg: EvalConfig, samples: Samples, micro_batch_size: int, backend: Backend,
                 module: nn.Module, bf16: bool, badput: Badput, emit: Emit, document_mask: bool = False,
                 n_batches: int | None = None):
        """n_batches: micro-batches per evaluation, cfg.batches unless the micro-batch was made smaller
        to fit (engine.fitting): then as many more, so each evaluation reads the same sequences."""
        self.cfg, self.backend, self.module, self.bf16 = cfg, backend, module, bf16
        self.n_batches = n_batches or cfg.batches
        self.batches = PackedLoader(samples, micro_batch_size, 1, position=backend.data, document_mask=document_mask,
                                    global_loss=backend.global_loss)
        self.badput, self.emit = badput, emit
        self.last_step: int | None = None

    def due(self, step: int, max_steps: int) -> bool:
        """After an interval's step; the last step's evaluation is `run` at the end of training."""
        every = self.cfg.interval_steps
        return every > 0 and step % every == 0 and step < max_steps

    def run(self, step: int) -> events.Eval:
        started = time.monotonic()
        with self.badput.timing("eval"), torch.no_grad():
            total = None
            counts = self.batches.target_counts(tuple(range(self.n_batches)))
            for index in range(self.n_batches):
                batch = self.batches.rows(index).map(self.backend.to_device)
                with self.backend.autocast(self.bf16):
                    loss = self.module(batch.inputs, batch.targets, batch.segments, batch.positions)[0].detach().float()
                # As device data, as the training step sends it: a Python float would be a constant
                # in the XLA graph, one compile per value.
                loss = loss * self.backend.to_device(torch.tensor(self.batches.weight(counts, index)))
                total = loss if total is None else total + loss
                self.backend.micro_step_end()
            values: list[float] = []
            self.backend.read_values([(total / self.n_batches).reshape(1)], lambda v: values.extend(v[0]))
            self.backend.flush()
        loss = values[0]
        perplexity = math.exp(min(loss, 700.0)) if math.isfinite(loss) else loss
        result = events.Eval(step, loss, perplexity, round(time.monotonic() - started, 3))
        log.info("eval", step=step, eval_loss=round(loss, 4), perplexity=round(perplexity, 2), seconds=result.seconds)
        self.emit(result)
        self.last_step = step
        return result
