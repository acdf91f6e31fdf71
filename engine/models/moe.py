"""A sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE), its router losses and statistics.

Routing is transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: a softmax over all
experts, the top k kept (renormalised to sum to 1 when norm_topk_prob), each token's output the
weighted sum of its k experts' SwiGLU. The experts' weights are 3-D tensors [experts, out, in],
each slice laid out as a Linear weight (Hugging Face's per-expert tensors, unchanged), so they
shard and multiply as one group.

Two compute paths with the same results when nothing is dropped:
- dropless (no capacity_factor): the (token, expert) pairs are sorted by expert, each expert
  multiplies its contiguous run of tokens, and the results are scattered back. Exact, at the cost
  of one host sync for the run lengths and shapes that change with the routing: cpu and cuda.
- capacity (capacity_factor set; XLA needs it): each expert has C = ceil(factor x tokens x k /
  experts) seats, filled first with every token's first choice, then the second choices, and so on
  (GShard's order: a token loses its weaker choices before anyone loses a stronger one). Tokens
  beyond an expert's seats are dropped from it (their weight is lost; the residual stream carries
  them on) and counted. Every shape is fixed by the batch, so XLA compiles one graph, and the
  experts run as one batched matmul over a [experts, C, dim] buffer that shards by expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ConfigError
from engine.spec.schema import MoEConfig

# What the routers report each step, beside the loss they add (router_terms' stats, in this order).
STATS = ("aux_loss", "z_loss", "expert_load_max", "expert_load_cv", "dropped_fraction")


@dataclass
class Routing:
    """Each MoE layer's router logits [tokens, experts] (fp32) and the (token, expert) choices it dropped."""

    logits: list[torch.Tensor] = field(default_factory=list)
    dropped: list[torch.Tensor] = field(default_factory=list)  # 0-dim counts; 0 on the dropless path


class MoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, cfg: MoEConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.capacity_factor = cfg.top_k, cfg.norm_topk_prob, cfg.capacity_factor
        self.router = nn.Linear(dim, cfg.num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(cfg.num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(cfg.num_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., dim] -> (output [..., dim], router logits [tokens, experts] in fp32, dropped choices)."""
        flat = x.reshape(-1, x.shape[-1])
        # fp32 whatever the autocast: a bf16 router flips near-tied top-k choices between backends.
        with torch.autocast(flat.device.type, enabled=False):
            logits = F.linear(flat.float(), self.router.weight.float())
        weights, experts = route(logits, self.top_k, self.norm_topk_prob)
        if self.capacity_factor is None:
            out, dropped = self.dropless(flat, weights, experts), logits.new_zeros(())
        else:
            out, dropped = self.with_capacity(flat, weights, experts)
        return out.view_as(x), logits, dropped

    def expert_mlp(self, x: torch.Tensor, e: int | None = None) -> torch.Tensor:
        """SwiGLU of expert e over rows x [N, dim]; with e None, of every expert over x [experts, C, dim]."""
        if e is not None:
            return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])
        gate, up = x @ self.w1.transpose(1, 2), x @ self.w3.transpose(1, 2)
        return (F.silu(gate) * up) @ self.w2.transpose(1, 2)

    def dropless(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [N, dim], weights and expert ids [N, k] -> sum over k of weight x expert(x) [N, dim]."""
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)
        token = order // self.top_k
        counts = torch.bincount(chosen, minlength=self.w1.shape[0]).tolist()
        outputs = [self.expert_mlp(rows, e) for e, rows in enumerate(x[token].split(counts))]
        # The weights stay fp32 until the product, as transformers multiplies them.
        weighted = torch.cat(outputs) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, weighted.to(x.dtype))

    def with_capacity(self, x: torch.Tensor, weights: torch.Tensor,
                      experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The capacity path's output [N, dim] and the number of (token, expert) choices it dropped."""
        n, k = experts.shape
        num_experts = self.w1.shape[0]
        seats = capacity(n, k, num_experts, self.capacity_factor)
        slot, kept = seating(experts, num_experts, seats)
        token = torch.arange(n, device=x.device).repeat(k)  # choice-major, as seating orders them
        # The spare last row takes every dropped choice and is never read back.
        buffer = x.new_zeros(num_experts * seats + 1, x.shape[-1]).index_add_(0, slot, x[token])
        out = self.expert_mlp(buffer[:-1].view(num_experts, seats, -1)).reshape(num_experts * seats, -1)
        gathered = torch.cat([out, out.new_zeros(1, out.shape[-1])])[slot]
        weighted = gathered * (weights.t().reshape(-1) * kept)[:, None]  # fp32 weights, as dropless
        combined = weighted.view(k, n, -1).sum(0)
        return combined.to(x.dtype), (~kept).sum().float()


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Seats per expert: factor x an even share of the tokens' choices; never more than the tokens
    (a token picks an expert at most once), never fewer than one."""
    return max(1, min(tokens, math.ceil(factor * tokens * top_k / num_experts)))


def seating(experts: torch.Tensor, num_experts: int, seats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [N, k] -> (slot, kept) [k x N] in choice-major order (all first choices, then all
    second ones): slot = expert x seats + the choice's seat, or num_experts x seats for a dropped one."""
    chosen = experts.t().reshape(-1)
    onehot = F.one_hot(chosen, num_experts).int()
    seat = (onehot.cumsum(0) * onehot).sum(-1) - 1  # how many took this expert before, itself included
    kept = seat < seats
    return torch.where(kept, chosen * seats + seat, num_experts * seats), kept


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (the k weights, the k expert ids) [N, k], largest probability first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _choice_counts(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """[E]: how many of the rows' top k choices went to each expert."""
    chosen = torch.topk(probs, top_k, dim=-1).indices.flatten()
    # scatter_add, not bincount: no host sync and no data-dependent shape.
    return torch.zeros(probs.shape[-1], device=probs.device).scatter_add_(
        0, chosen, torch.ones(chosen.numel(), device=probs.device))


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss as transformers' `load_balancing_loss_func` computes it
    (no attention mask): over every layer's tokens together, E x sum_e (the share of tokens that chose
    e among their top k, counted once per choice) x (e's mean router probability)."""
    probs = torch.softmax(torch.cat(router_logits).float(), dim=-1)
    rows = probs.shape[0]
    return num_experts * torch.sum(_choice_counts(probs, top_k) / rows * probs.sum(dim=0) / rows)


def z_loss(router_logits: list[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's router z-loss: each layer's mean over tokens of logsumexp(logits)^2, summed over layers
    (as ST-MoE and Megatron do: every router is held to the same strength whatever the depth)."""
    return sum(torch.logsumexp(logits.float(), dim=-1).square().mean() for logits in router_logits)


def router_loss(router_logits: list[torch.Tensor], cfg: MoEConfig) -> torch.Tensor:
    """What the routers add to the training loss: the weighted load-balancing and z-losses."""
    return router_terms(Routing(router_logits), cfg)[0]


def router_terms(routing: Routing, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(the routers' weighted loss, STATS [5] detached): the unweighted aux and z losses; the
    busiest expert's share of its layer's choices (1/E is even), the mean over layers of the
    shares' coefficient of variation; the fraction of choices the capacity dropped."""
    aux = load_balancing_loss(routing.logits, cfg.num_experts, cfg.top_k)
    z = z_loss(routing.logits)
    loss = cfg.router_aux_loss_coef * aux
    if cfg.router_z_loss_coef:
        loss = loss + cfg.router_z_loss_coef * z
    with torch.no_grad():
        shares = torch.stack([_choice_counts(torch.softmax(logits.detach().float(), dim=-1), cfg.top_k)
                              for logits in routing.logits])
        shares = shares / shares.sum(dim=-1, keepdim=True)
        cv = (shares.std(dim=-1, unbiased=False) / shares.mean(dim=-1)).mean()
        choices = sum(logits.shape[0] for logits in routing.logits) * cfg.top_k
        dropped = torch.stack(routing.dropped).sum() / choices if routing.dropped else shares.new_zeros(())
        stats = torch.stack([aux.detach(), z.detach().reshape(()), shares.max(), cv, dropped.to(shares.dtype)])
    return loss, stats


def require_static_capacity(moe, backend: str) -> None:
    """XLA compiles static shapes: experts there need a fixed number of seats. Checked once the
    backend is known (`device.backend: auto` picks xla on a TPU host)."""
    if moe is not None and moe.capacity_factor is None and backend == "xla":
        raise ConfigError("model.moe.capacity_factor", "must be set on the xla backend: XLA compiles static "
                          "shapes, so each expert gets a fixed number of seats (1.25 is usual)")
