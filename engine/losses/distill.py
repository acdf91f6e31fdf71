"""Knowledge distillation's loss: a student's distribution over the vocabulary pulled toward a
frozen teacher's, token by token, from both models' final hidden states and output heads.

Per token, with temperature T, p = softmax(teacher logits / T) and q = softmax(student logits / T):

- `forward_kl`: KL(p || q), Hinton's soft targets (the student covers every mode of the teacher);
- `reverse_kl`: KL(q || p) (mode-seeking, as in MiniLLM);
- `jsd`: beta x KL(p || m) + (1 - beta) x KL(q || m), m = beta x p + (1 - beta) x q (generalised
  Jensen-Shannon, bounded by log 2);

times T^2, so the gradients keep their scale as T changes (Hinton et al. 2015). The hard-label
cross-entropy enters only with its stated weight `alpha`: loss = (1 - alpha) x divergence +
alpha x CE. Targets equal to the ignore index (loss masks, padding, document masking's cut
positions) count in neither term, and the mean is over the targets kept, as the language
model's own loss.

Each token's two terms (the divergence and the hard-label cross-entropy, whatever alpha) can be
reported beside the loss (`with_terms`): the trainer logs them as distill_divergence and distill_ce.

An offline teacher (`topk_token_losses`) is its top k log-probabilities per token, stored with the
data: forward KL over those k tokens plus one outcome for the rest of the mass on each side.

`distill_loss` holds both models' logits at once: [N, V] each, in fp32. `chunked_distill_loss`
walks the tokens in chunks (engine.losses.chunked), so at most a chunk's rows of either exist;
the teacher takes no gradient.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from engine.losses.chunked import chunked_loss

Kind = Literal["forward_kl", "reverse_kl", "jsd"]


def divergence(log_student: torch.Tensor, log_teacher: torch.Tensor, kind: Kind, beta: float = 0.5) -> torch.Tensor:
    """Each row's divergence [N] between two log-distributions [N, V] (the module docstring's)."""
    if kind == "forward_kl":
        return (log_teacher.exp() * (log_teacher - log_student)).sum(-1)
    if kind == "reverse_kl":
        return (log_student.exp() * (log_student - log_teacher)).sum(-1)
    if kind != "jsd" or not 0 < beta < 1:
        raise ValueError(f"unknown divergence {kind!r} (beta {beta})")
    # logsumexp of the pair, not logaddexp: torch_xla runs logaddexp on the host (a graph cut per call).
    log_mix = torch.stack((log_teacher + math.log(beta), log_student + math.log1p(-beta))).logsumexp(0)
    return (beta * (log_teacher.exp() * (log_teacher - log_mix)).sum(-1)
            + (1 - beta) * (log_student.exp() * (log_student - log_mix)).sum(-1))


TERMS = ("distill_divergence", "distill_ce")  # what with_terms reports per token, in this order
_LOG_TINY = -80.0  # an offline teacher's tail mass that rounded to nothing, as a log


def token_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, teacher_hidden: torch.Tensor, *,
                 teacher_weight: torch.Tensor, kind: Kind = "forward_kl", temperature: float = 1.0,
                 beta: float = 0.5, alpha: float = 0.0, ignore_index: int = -100,
                 with_terms: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Each token's loss [N] of student hidden [N, D] and head [V, D] against the teacher's hidden
    [N, Dt] and head [V, Dt] (0 where ignored). with_terms: also its two terms [N, 2] without
    gradient (TERMS: the divergence times T^2, and the hard-label cross-entropy, taken whatever alpha)."""
    student = (hidden @ weight.T).float()
    with torch.no_grad():
        teacher = (teacher_hidden @ teacher_weight.T).float()
    log_student = F.log_softmax(student / temperature, dim=-1)
    loss = divergence(log_student, F.log_softmax(teacher / temperature, dim=-1), kind, beta) * temperature ** 2
    return _with_hard_label(loss, student, log_student, targets, temperature, alpha, ignore_index, with_terms)


def _with_hard_label(loss: torch.Tensor, student: torch.Tensor, log_student: torch.Tensor, targets: torch.Tensor,
                     temperature: float, alpha: float, ignore_index: int, with_terms: bool):
    """The divergence per token mixed with alpha x the hard-label cross-entropy, masked; with_terms: and TERMS."""
    kept = targets != ignore_index
    hard = None
    if alpha or with_terms:
        log_probs = log_student if temperature == 1 else F.log_softmax(student, dim=-1)
        if not alpha:
            log_probs = log_probs.detach()  # reported only: no gradient through it
        hard = -log_probs.gather(1, torch.where(kept, targets, 0)[:, None])[:, 0]
    terms = torch.stack((loss.detach(), hard.detach()), 1) if with_terms else None
    if alpha:
        loss = (1 - alpha) * loss + alpha * hard
    loss = torch.where(kept, loss, 0.0)
    return (loss, torch.where(kept[:, None], terms, 0.0)) if with_terms else loss


def distill_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, teacher_hidden: torch.Tensor,
                 teacher_weight: torch.Tensor, *, ignore_index: int = -100, **terms) -> torch.Tensor:
    """The mean token loss over the targets kept, from the full logits of both models."""
    kept = (targets != ignore_index).sum().clamp(min=1)
    return token_losses(hidden, weight, targets, teacher_hidden, teacher_weight=teacher_weight,
                        ignore_index=ignore_index, **terms).sum() / kept


def chunked_distill_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, *, ignore_index: int = -100,
                         chunk_tokens: int | None = None, losses=token_losses, with_terms: bool = False,
                         **terms) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """distill_loss, chunk_tokens tokens at a time (default: an eighth, at least 256); `losses` may
    be a compiled token_losses. with_terms: (the loss, TERMS' means over the targets kept)."""
    if teacher_hidden.shape[0] != hidden.shape[0] or teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"teacher and student disagree: hidden {tuple(teacher_hidden.shape)} vs "
                         f"{tuple(hidden.shape)}, heads of {teacher_weight.shape[0]} and {weight.shape[0]} tokens")
    if with_terms:
        terms["with_terms"] = True
    return chunked_loss(hidden, weight, targets, (teacher_hidden.detach(),), ignore_index=ignore_index,
                        chunk_tokens=chunk_tokens, losses=losses, stats=len(TERMS) if with_terms else 0,
                        teacher_weight=teacher_weight.detach(), **terms)


def topk_token_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, teacher_ids: torch.Tensor,
                      teacher_logp: torch.Tensor, *, temperature: float = 1.0, alpha: float = 0.0,
                      ignore_index: int = -100, with_terms: bool = False):
    """token_losses' forward KL against an offline teacher's top k [N, K] (ids, and log-probabilities at
    `temperature`), the rest of its mass one more outcome: KL over the k tokens and the tail, where
    the student's tail is its mass outside the teacher's k. With k = the vocabulary there is no tail
    and this is token_losses' forward_kl exactly."""
    student = (hidden @ weight.T).float()
    log_student = F.log_softmax(student / temperature, dim=-1)
    log_q = log_student.gather(1, teacher_ids.long())
    log_p = teacher_logp.float()
    loss = (log_p.exp() * (log_p - log_q)).sum(-1)
    if teacher_ids.shape[1] < weight.shape[0]:
        tail_p = (-torch.logsumexp(log_p, -1).exp()).log1p().clamp(min=_LOG_TINY)  # log(1 - sum p)
        tail_q = (-torch.logsumexp(log_q, -1).exp().clamp(max=1 - 1e-7)).log1p()
        loss = loss + tail_p.exp() * (tail_p - tail_q)
    loss = loss * temperature ** 2
    return _with_hard_label(loss, student, log_student, targets, temperature, alpha, ignore_index, with_terms)


def chunked_topk_distill_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                              teacher_ids: torch.Tensor, teacher_logp: torch.Tensor, *, ignore_index: int = -100,
                              chunk_tokens: int | None = None, losses=topk_token_losses, with_terms: bool = False,
                              **terms):
    """chunked_distill_loss against an offline teacher's top k (topk_token_losses)."""
    if with_terms:
        terms["with_terms"] = True
    return chunked_loss(hidden, weight, targets, (teacher_ids, teacher_logp.detach()), ignore_index=ignore_index,
                        chunk_tokens=chunk_tokens, losses=losses, stats=len(TERMS) if with_terms else 0, **terms)
