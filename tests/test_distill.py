"""Knowledge distillation's loss (engine.losses.distill): the chunked loss is the full-logits one,
value and gradients, for every divergence, temperature and hard-label weight, with masked targets."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from engine.losses.distill import chunked_distill_loss, distill_loss, divergence

IGNORE = -100


def problem(n: int = 300, d: int = 16, dt: int = 24, v: int = 97, seed: int = 0, masked: float = 0.25):
    """A student (hidden, head) and a teacher of another width over one vocabulary, and targets of
    which about `masked` are ignored (a loss mask, padding, a document's cut)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    teacher_hidden = torch.randn(n, dt, generator=g, dtype=torch.float64)
    teacher_weight = torch.randn(v, dt, generator=g, dtype=torch.float64) * 2 / math.sqrt(dt)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < masked] = IGNORE
    return hidden, weight, teacher_hidden, teacher_weight, targets


def value_and_grads(loss_fn, hidden, weight, *rest, **terms):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(h, w, *rest, **terms)
    loss.backward()
    return loss.detach(), h.grad, w.grad


KINDS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.1)]


@pytest.mark.parametrize("kind, beta", KINDS)
def test_the_chunked_loss_is_the_full_logits_loss_in_value_and_gradients(kind, beta):
    hidden, weight, teacher_hidden, teacher_weight, targets = problem()
    for temperature, alpha in itertools.product((1.0, 2.0, 0.5), (0.0, 0.3)):
        terms = dict(kind=kind, beta=beta, temperature=temperature, alpha=alpha)
        naive = value_and_grads(distill_loss, hidden, weight, targets, teacher_hidden, teacher_weight, **terms)
        # 300 tokens in chunks of 64: the last chunk is short.
        chunked = value_and_grads(chunked_distill_loss, hidden, weight, targets, teacher_hidden, teacher_weight,
                                  chunk_tokens=64, **terms)
        for a, b in zip(naive, chunked):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert naive[0] > 0 and naive[1].abs().sum() > 0


def test_the_loss_is_the_divergence_of_the_kept_targets_scaled_by_t_squared_and_alpha_is_never_implied():
    hidden, weight, teacher_hidden, teacher_weight, targets = problem(n=40, masked=0.5)
    kept = targets != IGNORE
    student, teacher = (hidden @ weight.T)[kept], (teacher_hidden @ teacher_weight.T)[kept]
    by_hand = F.kl_div(F.log_softmax(student / 2, -1), F.log_softmax(teacher / 2, -1), log_target=True,
                       reduction="batchmean") * 4
    assert distill_loss(hidden, weight, targets, teacher_hidden, teacher_weight, temperature=2.0).item() == (
        pytest.approx(by_hand.item(), rel=1e-6))  # the logits are taken in fp32
    hard = F.cross_entropy(student, targets[kept])
    mixed = distill_loss(hidden, weight, targets, teacher_hidden, teacher_weight, temperature=2.0, alpha=0.25)
    assert mixed.item() == pytest.approx(0.75 * by_hand.item() + 0.25 * hard.item(), rel=1e-6)
    # Every target ignored: nothing to learn, and no division by zero.
    none = torch.full_like(targets, IGNORE)
    assert distill_loss(hidden, weight, none, teacher_hidden, teacher_weight).item() == 0.0


def test_the_terms_reported_beside_the_loss_are_its_divergence_and_the_hard_cross_entropy_whatever_alpha():
    hidden, weight, teacher_hidden, teacher_weight, targets = problem(n=200)
    kept = targets != IGNORE
    hard = F.cross_entropy((hidden @ weight.T)[kept], targets[kept])
    for temperature, alpha in ((1.0, 0.0), (2.0, 0.3)):
        terms = dict(kind="jsd", beta=0.3, temperature=temperature)
        divergence_only = distill_loss(hidden, weight, targets, teacher_hidden, teacher_weight, **terms)
        plain = value_and_grads(chunked_distill_loss, hidden, weight, targets, teacher_hidden, teacher_weight,
                                alpha=alpha, chunk_tokens=64, **terms)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, means = chunked_distill_loss(h, w, targets, teacher_hidden, teacher_weight, alpha=alpha,
                                           chunk_tokens=64, with_terms=True, **terms)
        loss.backward()
        assert not means.requires_grad
        torch.testing.assert_close(means.double(), torch.stack([divergence_only, hard]), rtol=1e-5, atol=1e-7)
        for a, b in zip(plain, (loss.detach(), h.grad, w.grad)):  # reporting them changes nothing trained
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_each_divergence_is_zero_for_a_student_that_is_its_teacher_and_jsd_is_bounded_by_log_2():
    logits = torch.randn(50, 31, dtype=torch.float64) * 3
    other = torch.randn(50, 31, dtype=torch.float64) * 3
    same, log_other = F.log_softmax(logits, -1), F.log_softmax(other, -1)
    for kind, beta in KINDS:
        assert divergence(same, same, kind, beta).abs().max() < 1e-12
        assert (divergence(same, log_other, kind, beta) > 0).all()
    assert (divergence(same, log_other, "jsd") <= math.log(2)).all()
    # beta weighs the teacher's side: swapping the sides mirrors it.
    torch.testing.assert_close(divergence(same, log_other, "jsd", 0.2), divergence(log_other, same, "jsd", 0.8))
    with pytest.raises(ValueError):
        divergence(same, log_other, "jsd", 1.0)


def test_the_teacher_takes_no_gradient_and_must_share_the_vocabulary():
    hidden, weight, teacher_hidden, teacher_weight, targets = problem(n=64)
    teacher_hidden.requires_grad_()
    teacher_weight.requires_grad_()
    chunked_distill_loss(hidden.requires_grad_(), weight, targets, teacher_hidden, teacher_weight,
                         chunk_tokens=16).backward()
    assert teacher_hidden.grad is None and teacher_weight.grad is None and hidden.grad is not None
    with pytest.raises(ValueError, match="heads of 96 and 97 tokens"):
        chunked_distill_loss(hidden, weight, targets, teacher_hidden, teacher_weight[:96])


def test_an_offline_teachers_top_k_is_the_online_forward_kl_when_k_is_the_vocabulary_and_its_tail_counts_otherwise():
    from engine.losses.distill import chunked_topk_distill_loss

    hidden, weight, teacher_hidden, teacher_weight, targets = problem(v=50)
    for temperature, alpha in ((1.0, 0.0), (2.0, 0.3)):
        log_p = F.log_softmax((teacher_hidden @ teacher_weight.T) / temperature, -1)
        logp, ids = log_p.sort(-1, descending=True)
        online = value_and_grads(distill_loss, hidden, weight, targets, teacher_hidden, teacher_weight,
                                 temperature=temperature, alpha=alpha)
        whole = value_and_grads(chunked_topk_distill_loss, hidden, weight, targets, ids, logp,
                                temperature=temperature, alpha=alpha, chunk_tokens=64)
        for a, b in zip(online, whole):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
        # k of the 50: the teacher's 5 likeliest and one outcome for the other 45, on both sides.
        k = 5
        loss = chunked_topk_distill_loss(hidden, weight, targets, ids[:, :k], logp[:, :k], temperature=temperature,
                                         chunk_tokens=64)
        log_q = F.log_softmax((hidden @ weight.T) / temperature, -1)
        p_k, q_k = logp[:, :k].exp(), log_q.gather(1, ids[:, :k]).exp()
        p = torch.cat([p_k, 1 - p_k.sum(-1, keepdim=True)], -1)
        q = torch.cat([q_k, 1 - q_k.sum(-1, keepdim=True)], -1)
        kept = targets != IGNORE
        by_hand = (p * (p.log() - q.log())).sum(-1)[kept].mean() * temperature ** 2
        torch.testing.assert_close(loss.double(), by_hand, rtol=1e-5, atol=1e-7)  # the logits are fp32
