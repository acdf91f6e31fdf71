"""distill.hidden: chosen block outputs of the student learn the teacher's (TinyBERT's hidden-state loss).

Each pair (student block, teacher block) compares the student's block output, passed through a
learned linear projection to the teacher's width (none where the widths agree), with the teacher's
block output: the squared error's mean over the width, averaged over the tokens the loss takes
(targets not IGNORE), then over the pairs. The token mask is a weight, not an index, so the shapes
stay static under XLA. The trainer adds `weight` x this to the distribution's loss, as it adds a
mixture of experts' router losses, and reports it unweighted (HIDDEN).

The projections are trained student state, so they live on the student model itself, as
`distill_projections`: the optimizer, the gradient clip, DDP and FSDP, the replica fingerprint and
every checkpoint hold them as they hold its weights. The export to Hugging Face leaves them out (it
writes the Transformer's own parameters); a teacher loaded from such a checkpoint ignores them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from engine.data.batch import IGNORE
from engine.errors import ConfigError
from engine.spec.schema import HiddenDistillConfig, ModelConfig

ATTRIBUTE = "distill_projections"
HIDDEN = ("distill_hidden",)  # the step event's field: the mean squared error, before its weight


def attach(student: nn.Module, cfg: HiddenDistillConfig, teacher: ModelConfig) -> None:
    """Give the student its projections (on the current default device: meta, for the backend to
    place); ConfigError when a pair names a block the teacher does not have."""
    if past := [t for _, t in cfg.layers if t > teacher.n_layers]:
        raise ConfigError("distill.hidden.layers", f"names the teacher's block {past[0]}; it has {teacher.n_layers}")
    if student.cfg.dim != teacher.dim:
        setattr(student, ATTRIBUTE, nn.ModuleList(nn.Linear(student.cfg.dim, teacher.dim, bias=False)
                                                  for _ in cfg.layers))


def initial_values(student: nn.Module, generator: torch.Generator) -> Iterator[tuple[str, torch.Tensor]]:
    """The projections' initial values where the student's other weights come from elsewhere
    (model.init_from): drawn as the model's own initialisation draws a matrix."""
    std = student.cfg.init_std
    for name, param in getattr(student, ATTRIBUTE, nn.ModuleList()).named_parameters(prefix=ATTRIBUTE):
        value = torch.empty(param.shape)
        nn.init.trunc_normal_(value, std=std, a=-3 * std, b=3 * std, generator=generator)
        yield name, value


def hidden_loss(student: list[torch.Tensor], teacher: list[torch.Tensor], projections: nn.ModuleList | None,
                targets: torch.Tensor) -> torch.Tensor:
    """The mean over pairs of each one's squared error (mean over the width, then over the kept tokens)."""
    keep = (targets.flatten() != IGNORE).to(torch.float32)
    kept = keep.sum().clamp(min=1.0)
    total = keep.new_zeros(())
    for index, (ours, theirs) in enumerate(zip(student, teacher, strict=True)):
        ours = ours.flatten(0, 1)
        if projections is not None:
            ours = projections[index](ours)
        error = (ours.float() - theirs.flatten(0, 1).float()).pow(2).mean(-1)
        total = total + (error * keep).sum() / kept
    return total / len(student)
