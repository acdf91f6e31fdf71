"""A Llama-family decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

The model returns final hidden states, not logits: the loss takes (hidden, output weight,
targets) so that cut cross-entropy never materialises the (tokens x vocab) logits.
Attention is injected as a function (see engine/attention) so the same module runs the
sdpa, eager, flash and splash kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.moe import MoE, Routing
from engine.spec.schema import ModelConfig, RopeScaling

# (q [B, H, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D], mask) -> [B, H, T, D]: causal, and with a
# mask (the kernel's MaskFn of the segment ids) each token attends within its own document only.
AttentionFn = Callable[..., torch.Tensor]
# segment ids [B, T] -> the mask its kernel takes, made once per forward for every layer.
MaskFn = Callable[[torch.Tensor], object]
# Wraps a block call to recompute its activations in backward (backends supply their own).
CheckpointFn = Callable[..., torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 sums of squares lose too much precision.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rotary_tables(head_dim: int, max_seq_len: int, theta: float,
                  scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [max_seq_len, head_dim // 2], fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequencies: wavelengths longer than original_max / low_freq_factor are
    stretched by `factor`, those shorter than original_max / high_freq_factor kept, and those
    between blended linearly in original_max / wavelength."""
    wavelen = 2 * math.pi / inv_freq
    context = s.original_max_position_embeddings
    smooth = ((context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, T, T]: query t sees key s <= t of the same document (segment id)."""
    t = segments.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()
    return (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of x [B, H, T, D] by position-dependent angles; cos and
    sin broadcast against [B, H, T, D/2].

    The half-split layout (not interleaved pairs) keeps everything real-valued and
    contiguous, which XLA and the fused GPU kernels both handle well.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_fn: AttentionFn):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.attention_fn = attention_fn
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3: each head's queries and keys normed over the head, before rotation
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attention_fn(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Attention then a feed-forward, each on the normed residual stream: the dense SwiGLU
    (`feed_forward`), or with `cfg.moe` a mixture of experts (`moe`), and then the block also
    returns its router logits and dropped choices, which the training loss and its report need."""

    def __init__(self, cfg: ModelConfig, attention_fn: AttentionFn):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, attention_fn)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.sparse = cfg.moe is not None
        if self.sparse:
            self.moe = MoE(cfg.dim, cfg.expert_dim, cfg.moe)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        if not self.sparse:
            return x + self.feed_forward(self.ffn_norm(x))
        out, router_logits, dropped = self.moe(self.ffn_norm(x))
        return x + out, router_logits, dropped


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_fn: AttentionFn, checkpoint_fn: CheckpointFn | None = None,
                 mask_fn: MaskFn = document_mask):
        super().__init__()
        self.cfg, self.mask_fn = cfg, mask_fn
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, attention_fn) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.checkpoint_fn = checkpoint_fn if cfg.activation_checkpointing else None
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        # Not persistent: derived from the config, so never part of a checkpoint.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.tok_embeddings.weight.is_meta:  # built on the meta device, a backend materialises it
            self.init_weights()

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """The initial weights of torch.manual_seed's seed (`initial_values`): those a backend gives
        the same model built on the meta device."""
        params = dict(self.named_parameters())
        generator = torch.Generator().manual_seed(torch.initial_seed())
        for name, value in initial_values(self, generator):
            params[name].copy_(value)

    def reset_rotary(self, device: torch.device) -> None:
        """Compute the rotary tables on `device` (after the weights were materialised from meta)."""
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.cfg.rope_scaling)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, tokens: torch.Tensor, segments: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> final hidden states [B, T, dim] (after the last norm).

        With segment ids and positions [B, T] (document masking), each token attends only to
        earlier tokens of its own document, at RoPE positions that restart with each document."""
        return self.hidden_and_routing(tokens, segments, positions)[0]

    def hidden_and_routing(self, tokens: torch.Tensor, segments: torch.Tensor | None = None,
                           positions: torch.Tensor | None = None) -> tuple[torch.Tensor, Routing]:
        """`forward`'s hidden states, and each MoE layer's routing (empty when dense)."""
        hidden, routing, _ = self.features(tokens, segments, positions)
        return hidden, routing

    def features(self, tokens: torch.Tensor, segments: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None,
                 taps: Sequence[int] = ()) -> tuple[torch.Tensor, Routing, list[torch.Tensor]]:
        """`hidden_and_routing`'s, and the outputs of the blocks numbered in `taps` (from 1), in its order."""
        if positions is None:
            t = tokens.shape[1]
            cos, sin = self.rope_cos[:t][None, None], self.rope_sin[:t][None, None]
        else:
            cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        mask = None if segments is None else self.mask_fn(segments)
        h = self.tok_embeddings(tokens)
        routing = Routing()
        outputs = {}
        for number, layer in enumerate(self.layers, start=1):
            out = self.checkpoint_fn(layer, h, cos, sin, mask) if self.checkpoint_fn else layer(h, cos, sin, mask)
            if self.cfg.moe is None:
                h = out
            else:
                h, logits, dropped = out
                routing.logits.append(logits)
                routing.dropped.append(dropped)
            if number in taps:
                outputs[number] = h
        return self.norm(h), routing, [outputs[number] for number in taps]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.output_weight.T


def initial_values(model: nn.Module, generator: torch.Generator) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter's initial value, made on the CPU one tensor at a time, in parameter order, from
    one generator: the same weights on every backend for the same seed, with one tensor in host memory."""
    cfg = model.cfg
    std = cfg.init_std
    # Residual-branch outputs are scaled down so the residual stream's variance does
    # not grow with depth (GPT-2 / Llama practice).
    residual_std = std / math.sqrt(2 * cfg.n_layers)
    for name, param in model.named_parameters():
        value = torch.empty(param.shape)
        if name.endswith("norm.weight"):
            value.fill_(1.0)
        else:
            s = residual_std if name.endswith(("wo.weight", "w2.weight", "moe.w2")) else std
            nn.init.trunc_normal_(value, std=s, a=-3 * s, b=3 * s, generator=generator)
        yield name, value


def _block_weights(cfg: ModelConfig) -> int:
    """The weights of the transformer blocks' matmuls (projections and feed-forward) that a token
    goes through: with experts, the router and its top_k experts only."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = cfg.dim * (q_dim + 2 * kv_dim) + q_dim * cfg.dim + 3 * _down_weights(cfg)
    if cfg.moe is not None:
        per_layer += cfg.dim * cfg.moe.num_experts
    return cfg.n_layers * per_layer


def _down_weights(cfg: ModelConfig) -> int:
    """The weights of one layer's feed-forward down projections (w2) a token goes through."""
    if cfg.moe is None:
        return cfg.hidden_dim * cfg.dim
    return cfg.moe.top_k * cfg.expert_dim * cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 N + 12 L H Dh T (PaLM, appendix B).

    N counts every weight that takes part in a token's matmuls (with experts: the router and
    the top_k experts it picks, not the others), the output projection included
    (also when tied to the embedding); the embedding lookup itself is free. The second
    term is the attention score and value matmuls, forward and backward, with causal
    masking ignored as is conventional.
    """
    n = _block_weights(cfg) + cfg.dim * cfg.vocab_size
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The FLOPs per token that activation checkpointing adds, and MFU leaves out: each block's
    forward again in backward (2 per weight, and the attention's 4 L H Dh T), but for its last
    matmul, the feed-forward's down projection (w2), whose output no gradient needs."""
    if not cfg.activation_checkpointing:
        return 0.0
    weights = _block_weights(cfg) - cfg.n_layers * _down_weights(cfg)
    return 2.0 * weights + 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
