"""A sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE) and its router losses.

Routing is transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: a softmax over all
experts, the top k kept (renormalised to sum to 1 when norm_topk_prob), each token's output the
weighted sum of its k experts' SwiGLU. The experts' weights are 3-D tensors [experts, out, in],
each slice laid out as a Linear weight (Hugging Face's per-expert tensors, unchanged), so they
shard and multiply as one group.

The compute path here is the reference one: the (token, expert) pairs are sorted by expert, each
expert multiplies its contiguous run of tokens, and the results are scattered back. Dropless and
exact (no capacity factor), at the cost of one host sync for the run lengths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.spec.schema import MoEConfig


class MoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, cfg: MoEConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.router = nn.Linear(dim, cfg.num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(cfg.num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(cfg.num_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> (output [..., dim], router logits [tokens, experts] in fp32)."""
        flat = x.reshape(-1, x.shape[-1])
        # fp32 whatever the autocast: a bf16 router flips near-tied top-k choices between backends.
        with torch.autocast(flat.device.type, enabled=False):
            logits = F.linear(flat.float(), self.router.weight.float())
        weights, experts = route(logits, self.top_k, self.norm_topk_prob)
        return self.experts(flat, weights, experts).view_as(x), logits

    def experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [N, dim], weights and expert ids [N, k] -> sum over k of weight x expert(x) [N, dim]."""
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)
        token = order // self.top_k
        counts = torch.bincount(chosen, minlength=self.w1.shape[0]).tolist()
        outputs = []
        for e, rows in enumerate(x[token].split(counts)):
            outputs.append(F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]), self.w2[e]))
        # The weights stay fp32 until the product, as transformers multiplies them.
        weighted = torch.cat(outputs) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, weighted.to(x.dtype))


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (the k weights, the k expert ids) [N, k], largest probability first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss as transformers' `load_balancing_loss_func` computes it
    (no attention mask): over every layer's tokens together, E x sum_e (the share of tokens that chose
    e among their top k, counted once per choice) x (e's mean router probability)."""
    probs = torch.softmax(torch.cat(router_logits).float(), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    rows = probs.shape[0]
    # scatter_add, not bincount: no host sync and no data-dependent shape.
    counts = torch.zeros(num_experts, device=probs.device).scatter_add_(
        0, chosen.flatten(), torch.ones(chosen.numel(), device=probs.device))
    return num_experts * torch.sum(counts / rows * probs.sum(dim=0) / rows)


def z_loss(router_logits: list[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's router z-loss: each layer's mean over tokens of logsumexp(logits)^2, summed over layers
    (as ST-MoE and Megatron do: every router is held to the same strength whatever the depth)."""
    return sum(torch.logsumexp(logits.float(), dim=-1).square().mean() for logits in router_logits)


def router_loss(router_logits: list[torch.Tensor], cfg: MoEConfig) -> torch.Tensor:
    """What the routers add to the training loss: the weighted load-balancing and z-losses."""
    loss = cfg.router_aux_loss_coef * load_balancing_loss(router_logits, cfg.num_experts, cfg.top_k)
    if cfg.router_z_loss_coef:
        loss = loss + cfg.router_z_loss_coef * z_loss(router_logits)
    return loss
