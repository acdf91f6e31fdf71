"""The job spec: one pydantic model per section, validated once at the edge.

This module must stay importable without torch: the daemon validates job files with it
and never imports torch. Loading YAML (includes, overrides, line numbers) lives in
`engine/spec/loader.py`; this file only says what a valid job is.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal, get_args

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError,
                      model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

from engine.spec.fingerprint import RESUMABLE

_GCS_URL = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/\S*)?$")


class Section(BaseModel):
    # Unknown keys are errors: a typo must never silently fall back to a default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RopeScaling(Section):
    """Llama 3.1's rope scaling (Hugging Face rope_type "llama3"): long wavelengths are divided by
    `factor`, short ones kept, those between interpolated smoothly."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: PositiveInt

    @model_validator(mode="after")
    def _bounds_ordered(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                             f"({self.low_freq_factor})")
        return self


class MoEConfig(Section):
    """Sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): each token goes to its top_k of
    num_experts SwiGLU experts, weighted by the router's softmax."""

    num_experts: PositiveInt = Field(description="Experts per layer.")
    top_k: PositiveInt = Field(description="Experts each token is routed to.")
    norm_topk_prob: bool = Field(True, description="Renormalise the top_k router probabilities to sum to 1 "
                                 "(Mixtral always does; Qwen3-MoE per its config).")
    expert_ffn_dim: PositiveInt | None = Field(None, description="Each expert's SwiGLU hidden size; default = "
                                               "the model's ffn_dim.")
    router_aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the load-balancing loss (Switch "
                                        "Transformer's, as transformers computes it) added to the training loss.")
    router_z_loss_coef: float = Field(0.0, ge=0, description="Weight of the router z-loss (mean squared "
                                      "logsumexp of the router logits, ST-MoE) added to the training loss.")
    capacity_factor: float | None = Field(
        None, gt=0, description="Seats per expert as a multiple of an even share of the tokens' choices; a "
        "choice beyond its expert's seats is dropped (counted as dropped_fraction). Unset: dropless (cpu and "
        "cuda). The xla backend needs it (static shapes): 1.25 is usual, num_experts / top_k drops nothing.")

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be at most num_experts ({self.num_experts}): a token "
                             "cannot go to more experts than there are")
        return self


class ModelConfig(Section):
    """A Llama-family decoder. Presets live in configs/models/*.yaml."""

    init_from: str | None = Field(
        None, description="A Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE directory (config.json + *.safetensors; local, gs://, or a "
        "Hugging Face Hub id org/name[@revision], resolved through huggingface_hub's cache) to start from when "
        "the job has no checkpoint of its own. Dimensions left out are taken from its config.json; any set must match "
        "(model.moe key by key; its router loss coefficients are the job's to choose).")

    vocab_size: PositiveInt = 256
    dim: PositiveInt = 128
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    n_kv_heads: PositiveInt | None = Field(None, description="Grouped-query attention; default = n_heads.")
    head_size: PositiveInt | None = Field(None, description="Each attention head's size; default = dim / n_heads "
                                          "(Qwen3 sets its own: the projections then map dim to n_heads x head_size).")
    qk_norm: bool = Field(False, description="RMSNorm of each head's queries and keys before the rotary embedding "
                          "(Qwen3).")
    ffn_dim: PositiveInt | None = Field(None, description="SwiGLU hidden size; default = 8/3 dim rounded up to multiple_of.")
    multiple_of: PositiveInt = 64
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = Field(None, description="Llama 3.1+ rope scaling; none by default.")
    max_seq_len: PositiveInt = 2048
    tie_embeddings: bool = True
    activation_checkpointing: bool = False
    init_std: float = Field(0.02, gt=0)
    moe: MoEConfig | None = Field(None, description="Mixture-of-experts feed-forward in every layer; none (dense) "
                                  "by default. On xla it needs capacity_factor; device.mesh.expert splits the "
                                  "experts over devices.")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.head_size is None and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), or head_size set")
        if self.kv_heads > self.n_heads or self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"the head size ({self.head_dim}) must be even for rotary embeddings")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * -(-hidden // self.multiple_of)

    @property
    def expert_dim(self) -> int:
        """The experts' SwiGLU hidden size (moe set)."""
        assert self.moe is not None
        return self.moe.expert_ffn_dim or self.hidden_dim


AttentionKernel = Literal["auto", "sdpa", "eager", "flex", "flash", "splash"]


class FlashBlocks(Section):
    """Block sizes of torch_xla's Pallas flash attention (TPU); defaults are torch_xla's."""

    block_b: PositiveInt = 2
    block_q: PositiveInt = 512
    block_k_major: PositiveInt = 512
    block_k: PositiveInt = 512
    block_q_major_dkv: PositiveInt = 512
    block_k_major_dkv: PositiveInt = 512
    block_q_dkv: PositiveInt = 512
    block_k_dkv: PositiveInt = 512
    block_q_dq: PositiveInt = 1024
    block_k_dq: PositiveInt = 256
    block_k_major_dq: PositiveInt = 512


class SplashBlocks(Section):
    """Block sizes of torch_xla's Pallas splash attention (TPU); each is capped at the sequence length."""

    block_q: PositiveInt = 2048
    block_kv: PositiveInt = 2048
    block_kv_compute: PositiveInt = 2048
    block_q_dkv: PositiveInt = 2048
    block_kv_dkv: PositiveInt = 2048
    block_kv_dkv_compute: PositiveInt = 2048
    block_q_dq: PositiveInt = 2048
    block_kv_dq: PositiveInt = 2048


class AttentionConfig(Section):
    kernel: AttentionKernel = Field(
        "auto", description="auto picks the best kernel the backend has; an unavailable kernel is an error."
    )
    flash: FlashBlocks = FlashBlocks()
    splash: SplashBlocks = SplashBlocks()


class MixtureEntry(Section):
    dataset: str = Field(description="A prepared dataset (tpud prepare): a directory or gs://bucket/prefix.")
    weight: float = Field(gt=0, description="Its share of the training samples, relative to the other entries.")


class DataConfig(Section):
    dataset: str | None = Field(
        None, description="A prepared dataset (tpud prepare): a directory or gs://bucket/prefix. The vocabulary "
        "and special tokens come from its manifest. Default: the built-in corpus.")
    mixture: list[MixtureEntry] = Field(
        [], description="Several prepared datasets blended in these proportions, deterministically; instead of "
        "dataset.")
    allow_change: bool = Field(
        False, description="Resume a checkpoint trained on other data (a different dataset identity or mixture); "
        "by default that is an error.")
    corpus: Literal["stdlib"] = Field(
        "stdlib", description="Without dataset or mixture: stdlib, the Python standard library's source, "
        "byte-tokenized; present everywhere (the demo).")
    corpus_bytes: PositiveInt = Field(8_000_000, description="Upper bound on the built-in corpus's size.")
    seq_len: PositiveInt = 256
    micro_batch_size: PositiveInt | Literal["auto"] = Field(
        16, description="Sequences per micro-batch per data-parallel rank. auto: the largest that fits in memory, "
        "found from the whole per-rank batch (train.global_batch_size / ranks) by halving on out-of-memory errors "
        "(engine.fitting); it needs train.global_batch_size. A fixed size is made smaller the same way when "
        "train.fit_micro_batch allows.")
    document_mask: bool = Field(
        False, description="Each token attends only to earlier tokens of its own document, at RoPE positions that "
        "restart with it, and no loss is taken on predicting a document's first token from the previous one; "
        "documents come from the dataset's stored boundaries (the built-in corpus: its files). Needs a kernel "
        "that masks: cpu sdpa or eager, cuda flex or eager, any xla kernel.")
    skip: list[tuple[NonNegativeInt, PositiveInt]] = Field(
        [], max_length=10_000, description="Ranges [first, count] of the run's samples (global indices into its stream, as `tpud "
        "status` and the skip ledger show them) never trained on: a known bad shard, or another run's ledger to "
        "train on exactly its samples. Whole micro-batches are skipped: every one holding a listed sample.")

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.dataset is not None and self.mixture:
            raise ValueError("give data.dataset or data.mixture, not both")
        total = sum(entry.weight for entry in self.mixture)
        _located(type(self).__name__, [
            (("mixture", i, "weight"), entry.weight, "is {share} of the mixture, below the 0.1% that "
             "deterministic blending resolves", {"share": f"{entry.weight / total:.2%}"})
            for i, entry in enumerate(self.mixture) if entry.weight / total < 0.001])
        return self

    @property
    def datasets(self) -> list[tuple[str, float]]:
        """(dataset, weight) of every prepared dataset the job reads; empty for the built-in corpus."""
        if self.dataset is not None:
            return [(self.dataset, 1.0)]
        return [(entry.dataset, entry.weight) for entry in self.mixture]


class EvalConfig(Section):
    """Validation loss on the dataset's held-out split (tpud prepare --val-fraction or --val-docs)."""

    interval_steps: NonNegativeInt = Field(
        0, description="Evaluate every N steps; 0: only at the end of training (which always evaluates).")
    batches: PositiveInt = Field(
        8, description="Micro-batches per evaluation: the same ones every time, so the values compare.")


def _located(model: str, problems: list[tuple[tuple[str | int, ...], object, str, dict[str, object]]]) -> None:
    """Raise one ValidationError whose errors name their keys (loc), relative to `model`.

    pydantic-core passes a ValidationError raised by a validator through and prefixes the
    locs of enclosing sections, so an error at ("batch_ramp", 1, "until_step") in TrainConfig
    reaches the user as train.batch_ramp.1.until_step.
    """
    if problems:
        raise ValidationError.from_exception_data(model, [
            InitErrorDetails(type=PydanticCustomError("section", message, ctx), loc=loc, input=value)
            for loc, value, message, ctx in problems
        ])


class RampStage(Section):
    until_step: PositiveInt = Field(description="Steps before this one, from the previous until_step, are in the stage.")
    grad_accum_steps: PositiveInt = Field(description="Micro-batches per optimizer step in this stage.")


class TrainConfig(Section):
    max_steps: PositiveInt = 300
    grad_accum_steps: PositiveInt = Field(1, description="Micro-batches per optimizer step (after any batch_ramp).")
    seed: int = 0
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm; 0 disables clipping.")
    log_interval: PositiveInt = 10
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto = bf16 autocast on cuda and xla, fp32 on cpu."
    )
    batch_ramp: list[RampStage] = Field(
        [], description="Batch-size ramp: stages of fewer micro-batches per step, in ascending until_step, then "
        "grad_accum_steps. Micro-batch shapes never change (static XLA shapes); only their number per step does.",
    )
    fit_micro_batch: bool = Field(
        True, description="On an out-of-memory error in a worker's first steps, halve data.micro_batch_size and "
        "double the micro-batches per step (the batch and the maths unchanged up to summation order), record the "
        "size in the job's state (micro_batch.json: later starts begin there) and restart at once; at 1 sequence "
        "the job fails, naming the memory needed and available. false: such an error is a crash like any other, and "
        "the job file's size runs as written.")
    global_batch_size: PositiveInt | None = Field(
        None, description="Sequences per optimizer step across all hosts, kept when the job resumes on another "
        "number of hosts: each host's micro-batch is the largest divisor of global_batch_size / hosts not above "
        "data.micro_batch_size, and grad_accum_steps follows. Unset: micro_batch_size x grad_accum_steps per host.",
    )

    @model_validator(mode="after")
    def _ramp_ascends(self) -> TrainConfig:
        problems: list = []
        if self.global_batch_size is not None:
            for key in ("grad_accum_steps", "batch_ramp"):
                if key in self.model_fields_set:
                    problems.append(((key,), getattr(self, key),
                                     "must not be set with train.global_batch_size, which decides it", {}))
        prev_until, prev_accum = 0, 1
        for i, stage in enumerate(self.batch_ramp):
            if stage.until_step <= prev_until:
                problems.append((("batch_ramp", i, "until_step"), stage.until_step,
                                 "must exceed the previous stage's until_step ({prev})", {"prev": prev_until}))
            elif stage.until_step > self.max_steps:
                problems.append((("batch_ramp", i, "until_step"), stage.until_step,
                                 "must not exceed train.max_steps ({max_steps})", {"max_steps": self.max_steps}))
            if stage.grad_accum_steps > self.grad_accum_steps:
                problems.append((("batch_ramp", i, "grad_accum_steps"), stage.grad_accum_steps,
                                 "must not exceed train.grad_accum_steps ({final}), the batch the ramp ends at",
                                 {"final": self.grad_accum_steps}))
            elif stage.grad_accum_steps < prev_accum:
                problems.append((("batch_ramp", i, "grad_accum_steps"), stage.grad_accum_steps,
                                 "must not be below the previous stage's ({prev}): the ramp only grows the batch",
                                 {"prev": prev_accum}))
            prev_until, prev_accum = max(prev_until, stage.until_step), max(prev_accum, stage.grad_accum_steps)
        _located(type(self).__name__, problems)
        return self


class LionConfig(Section):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the update is
    sign(b1 m + (1 - b1) g), then m = b2 m + (1 - b2) g; one state tensor per parameter.

    A sign update has a larger norm than AdamW's, so Lion wants an lr 3-10x smaller and a
    weight decay 3-10x larger than AdamW's, keeping lr x weight_decay (the decay per step)
    about the same. The defaults derive both from optimizer.lr and optimizer.weight_decay.
    """

    lr: float | None = Field(None, gt=0, description="Default: optimizer.lr / 3 (Lion wants an lr 3-10x below AdamW's).")
    betas: tuple[float, float] = Field(
        (0.9, 0.99), description="b1 mixes gradient and momentum for the update's sign, b2 is the momentum's decay."
    )
    weight_decay: float | None = Field(
        None, ge=0, description="Decoupled (p -= lr wd p); not on norms, biases and embeddings. "
        "Default: optimizer.weight_decay x 3, so lr x weight_decay matches AdamW's.",
    )

    @model_validator(mode="after")
    def _betas_in_range(self) -> LionConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas {self.betas} must lie in [0, 1)")
        return self


class MuonConfig(Section):
    """Muon (torch.optim.Muon) for the 2-D matrices of the transformer blocks (wq wk wv wo w1 w2
    w3): momentum, then Newton-Schulz orthogonalisation of the update. The embeddings, the
    output head, norms and biases stay on AdamW with optimizer.lr, betas, eps, weight_decay.
    """

    adjust_lr_fn: Literal["match_rms_adamw", "original"] = Field(
        "match_rms_adamw", description="Per-matrix lr scale for an A x B matrix. match_rms_adamw (Moonshot, "
        "'Muon is Scalable for LLM Training'): lr x 0.2 sqrt(max(A, B)), which gives updates AdamW's RMS, so "
        "Muon shares AdamW's lr and weight decay. original (Keller Jordan): lr x sqrt(max(1, A/B)); "
        "needs its own, much larger lr (~0.02).",
    )
    lr: float | None = Field(
        None, gt=0, description="Muon's peak lr, before the per-matrix scale. Default: optimizer.lr; "
        "required with adjust_lr_fn=original (e.g. 0.02).",
    )
    weight_decay: float | None = Field(
        None, ge=0, description="Decoupled (p -= lr wd p, unscaled lr). Default: optimizer.weight_decay."
    )
    momentum: float = Field(0.95, ge=0, lt=1, description="buf = momentum buf + (1 - momentum) grad.")
    nesterov: bool = Field(True, description="Orthogonalise (1 - momentum) grad + momentum buf instead of buf.")
    ns_steps: PositiveInt = Field(
        5, lt=100, description="Quintic Newton-Schulz iterations, coefficients (3.4445, -4.7750, 2.0315)."
    )

    @model_validator(mode="after")
    def _original_needs_lr(self) -> MuonConfig:
        if self.adjust_lr_fn == "original" and self.lr is None:
            raise ValueError("adjust_lr_fn=original needs an explicit lr (e.g. 0.02): its scale is not AdamW's")
        return self


class OptimizerConfig(Section):
    """lr, betas, eps and weight_decay are AdamW's, and also Muon's AdamW part (embeddings, head,
    norms, biases). Lion and Muon have their own sections; their lr and weight decay derive
    from these unless set."""

    name: Literal["adamw", "lion", "muon"] = Field(
        "adamw", description="adamw | lion | muon (Muon on the blocks' matrices, AdamW on the rest)."
    )
    lr: float = Field(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0, description="Not applied to norms, biases and embeddings.")
    lion: LionConfig = LionConfig()
    muon: MuonConfig = MuonConfig()


ScheduleName = Literal["cosine", "wsd", "linear", "constant"]
# The schedules that use each optional key; setting one for another schedule is an error.
SCHEDULE_KEY_USERS: dict[str, tuple[str, ...]] = {
    "min_lr_ratio": ("cosine", "linear", "wsd"),
    "decay_fraction": ("wsd",),
    "decay_shape": ("wsd",),
}


class SchedulerConfig(Section):
    """The lr as a multiple of the peak lr, a pure function of the step (engine/optim/schedule.py).

    Every schedule warms up linearly over warmup_steps, then: cosine and linear decay from the
    peak to min_lr_ratio at the last step; wsd (warmup-stable-decay) holds the peak and decays
    over the last decay_fraction of train.max_steps; constant holds the peak. Setting a key the
    chosen schedule does not use is an error, whatever its value (SCHEDULE_KEY_USERS).
    """

    name: ScheduleName = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr / peak lr; cosine, linear and wsd.")
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd: fraction of train.max_steps spent decaying (rounded; at least one step)."
    )
    decay_shape: Literal["1-sqrt", "linear"] = Field(
        "1-sqrt", description="wsd: the decay curve, 1 - sqrt(progress) (Hägele et al. 2024) or 1 - progress."
    )

    @model_validator(mode="after")
    def _keys_of_this_schedule(self) -> SchedulerConfig:
        _located(type(self).__name__, [
            ((key,), getattr(self, key), "is not used by the {name} schedule (only by {users}); remove it",
             {"name": self.name, "users": ", ".join(users)})
            for key, users in SCHEDULE_KEY_USERS.items() if key in self.model_fields_set and self.name not in users
        ])
        return self


def _mib(value: object) -> object:
    """One message for both forms, not one per branch of the union."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ValueError("must be a number of MiB (above 0) or auto")


class LossConfig(Section):
    name: Literal["auto", "ce", "chunked", "cce"] = Field(
        "auto", description="ce: the full logits, fastest while they fit; chunked: the logits of chunk_tokens "
        "tokens at a time, each chunk's backward done in forward; cce: cut cross-entropy, never holds more than "
        "a small tile of logits (the least memory, the slowest). auto: ce while one micro-batch's fp32 logits "
        "on one device fit logits_budget_mib, else chunked.")
    logits_budget_mib: Annotated[PositiveInt | Literal["auto"], BeforeValidator(_mib)] = Field(
        "auto", description="The most memory a micro-batch's fp32 logits may take on one device for loss.name auto "
        "to pick ce. auto: a sixteenth of the device's memory on cuda, the smallest device's of the job's processes (5 "
        "GiB on an 80 GB H100, where ce's steps took 5-15 % less time than chunked's), 1024 MiB on cpu and xla.")
    chunk_tokens: PositiveInt | None = Field(
        None, description="chunked only: tokens per chunk (default: an eighth of the micro-batch's, at least 256).")
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    z_loss: float = Field(0.0, ge=0, description="Weight of PaLM's auxiliary z-loss, logsumexp(logits)^2 per token.")
    softcap: float | None = Field(None, gt=0, description="Soft-cap the logits as c * tanh(logits / c) (Gemma 2).")
    focal_gamma: float = Field(
        0.0, ge=0, description="Focal loss (1 - p)^gamma * CE (Lin et al. 2017); 0 is plain CE, else >= 1.")
    chunk_size: PositiveInt | None = Field(
        None, description="cce only: vocabulary rows per chunk; default keeps one chunk's logits near 8 MiB.")

    @model_validator(mode="after")
    def _honourable(self) -> LossConfig:
        problems = []
        if 0 < self.focal_gamma < 1:
            # The focal gradient has a (1 - p)^(gamma - 1) factor: unbounded as p -> 1.
            problems.append(("focal_gamma", self.focal_gamma, "must be 0 (off) or at least 1"))
        if self.focal_gamma and self.label_smoothing:
            problems.append(("label_smoothing", self.label_smoothing, "cannot be combined with focal_gamma"))
        if self.chunk_size and self.name in ("ce", "chunked"):
            problems.append(("chunk_size", self.chunk_size, "vocabulary chunks are the cce loss's"))
        if self.chunk_tokens and self.name in ("ce", "cce"):
            problems.append(("chunk_tokens", self.chunk_tokens, "token chunks are the chunked loss's"))
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, [
                InitErrorDetails(type=PydanticCustomError("loss_option", message), loc=(key,), input=value)
                for key, value, message in problems])
        return self


class HiddenDistillConfig(Section):
    """A hidden-state loss beside the distribution's (TinyBERT's): chosen block outputs of the student
    learn the teacher's, through a learned projection where their widths differ (engine.distill.hidden)."""

    layers: list[tuple[PositiveInt, PositiveInt]] = Field(
        min_length=1, description="(student layer, teacher layer) pairs, each the output of that block, counted "
        "from 1: [[2, 4], [4, 8]] has the student's 2nd block learn the teacher's 4th, and its 4th the 8th.")
    weight: float = Field(gt=0, description="Its weight: loss = the distribution's loss + weight x the mean "
                          "squared error over the pairs (per token and width, the projection's output against the "
                          "teacher's hidden state).")


class DistillConfig(Section):
    """Knowledge distillation: the student (this job's model) learns a frozen teacher's distribution
    over the vocabulary, token by token, in chunks (engine.losses.distill). The teacher runs beside
    the student, in eval mode, sharded like it, and is never checkpointed; its identity (a digest of
    its weight files) is recorded in every checkpoint and must be the same on resume."""

    teacher: str = Field(description="The teacher: a Hugging Face model directory (local, gs://, or a hub id "
                         "org/name[@revision]), or a tpud "
                         "checkpoint (a job's checkpoint directory, meaning its newest committed step, or one "
                         "step_N directory). Its vocabulary must be the student's (model.vocab_size and the "
                         "tokenizer). offline: no teacher in memory; every dataset carries a teacher's top-k "
                         "log-probabilities (tpud prepare --teacher), trained on with forward_kl over the top k plus "
                         "the rest's mass.")
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "forward_kl", description="forward_kl: KL(teacher || student), Hinton's soft targets; reverse_kl: "
        "KL(student || teacher), mode-seeking; jsd: the generalised Jensen-Shannon divergence (beta).")
    beta: float = Field(0.5, gt=0, lt=1, description="jsd only: the teacher's weight in the mixture.")
    temperature: float = Field(1.0, gt=0, description="Both distributions are softened by it; the loss is "
                               "scaled by its square so the gradients keep their size.")
    alpha: float = Field(0.0, ge=0, le=1, description="The weight of the hard-label cross-entropy: loss = (1 - "
                         "alpha) x divergence + alpha x CE. 0 (the default): the divergence alone.")
    chunk_tokens: PositiveInt | None = Field(
        None, description="Tokens per chunk of the loss (default: an eighth of the micro-batch's, at least 256).")
    hidden: HiddenDistillConfig | None = Field(
        None, description="A hidden-state loss too (default: none). Where the widths differ, the student learns "
        "one projection per pair (model.dim to the teacher's): trained, checkpointed and resumed with the "
        "student, left out of its export.")

    @property
    def offline(self) -> bool:
        """The teacher's top-k predictions stored with the data (`tpud prepare --teacher`), no teacher model."""
        return self.teacher == "offline"

    @model_validator(mode="after")
    def _offline_is_forward_kl(self) -> DistillConfig:
        if self.offline and self.loss != "forward_kl":
            raise ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(
                type=PydanticCustomError("offline_loss", "offline: only forward_kl (the stored top-k and their "
                                         "tail's mass cover the teacher's side alone)"), loc=("loss",),
                input=self.loss)])
        if self.offline and self.hidden is not None:
            raise ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(
                type=PydanticCustomError("offline_hidden", "needs a teacher model: an offline teacher stores its "
                                         "predictions, not its hidden states"), loc=("hidden",), input="hidden")])
        return self


class MeshConfig(Section):
    """How the devices share the model. One axis may be -1: all devices not used by the others.
    Under xla, SPMD axes over the host's devices; on cpu and cuda, over the job's processes: an
    fsdp axis above 1 shards weights, gradients and optimizer state with FSDP2 (HSDP with data
    replicas), fsdp 1 replicates the model with DDP (`data: -1, fsdp: 1`), and the hosts of a gang are
    always replicas (each host checkpoints a whole state, sharded over its own processes unless
    fsdp is 1); tensor is xla's alone."""

    data: int = 1
    expert: int = Field(1, description="Expert parallelism (xla): the experts of each MoE layer are split over "
                        "this axis, which also splits the batch; 1 shards experts over fsdp like other weights.")
    fsdp: int = -1
    tensor: int = 1

    @model_validator(mode="after")
    def _one_wildcard(self) -> MeshConfig:
        sizes = (self.data, self.expert, self.fsdp, self.tensor)
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError("at most one mesh axis may be -1")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError("mesh axes must be positive or -1")
        return self

    def resolve(self, num_devices: int) -> dict[str, int]:
        sizes = {"data": self.data, "expert": self.expert, "fsdp": self.fsdp, "tensor": self.tensor}
        fixed = 1
        for s in sizes.values():
            fixed *= s if s > 0 else 1
        if num_devices % fixed:
            raise ValueError(f"mesh {sizes} does not divide {num_devices} devices")
        for axis, s in sizes.items():
            if s == -1:
                sizes[axis] = num_devices // fixed
        product = sizes["data"] * sizes["expert"] * sizes["fsdp"] * sizes["tensor"]
        if product != num_devices:
            raise ValueError(f"mesh {sizes} uses {product} devices, but {num_devices} are present")
        return sizes


class DeviceConfig(Section):
    backend: Literal["auto", "cpu", "cuda", "xla"] = Field(
        "auto", description="auto: xla on a TPU host, else cuda when present, else cpu."
    )
    mesh: MeshConfig = MeshConfig()
    compile: Literal["auto"] | bool = Field(
        "auto", description="torch.compile each transformer block and the loss (cpu and cuda). auto: on for cuda, "
        "off for cpu; xla compiles whole steps by itself.")
    compile_cache: bool = Field(True, description="Persistent compilation caches (XLA's, or torch.compile's) under "
                                "the job's state directory, so a restart does not compile from nothing.")
    peak_flops: float | None = Field(
        None, gt=0, description="Peak FLOP/s per device for MFU; detected for known TPUs and GPUs."
    )
    deterministic: bool = Field(
        False, description="Bitwise-reproducible kernels on cpu and cuda (torch.use_deterministic_algorithms, "
        "cuBLAS's fixed workspace): a run resumed from a checkpoint repeats the uninterrupted one bit for bit, at "
        "some cost in speed; an operation with no deterministic implementation fails the worker, naming it. xla needs "
        "nothing: its compiled steps repeat by themselves.")
    processes_per_host: PositiveInt | Literal["auto"] = Field(
        "auto", description="Worker processes the daemon starts for the job on each host and supervises as one: "
        "they shard the model among themselves (FSDP2 over torch.distributed), each with its rank and local rank, "
        "heartbeats and hang judgement; one's death or hang restarts them all. auto: one per visible GPU on cuda "
        "(CUDA_VISIBLE_DEVICES, else the driver's list), one on cpu and xla (one xla process drives every chip). "
        "More than one on cpu runs gloo (tests). A daemon refuses more than its GPUs (cuda) or cores (cpu). In a gang "
        "a host's processes shard its state and the hosts are its replicas (HSDP); every host must run as many.")


def _interval(value: object) -> object:
    """One message for both forms, not one per branch of the union."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError("must be a number of steps (0: off) or auto")


Interval = Annotated[Annotated[int, Field(ge=0)] | Literal["auto"], BeforeValidator(_interval)]


def _seconds_interval(value: object) -> object:
    if value == "auto" or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf):
        return value
    raise ValueError("must be a number of seconds (0: every committed step) or auto")


SecondsInterval = Annotated[Annotated[float, Field(ge=0)] | Literal["auto"], BeforeValidator(_seconds_interval)]


class MemoryTierConfig(Section):
    """Checkpoints in host shared memory (a tmpfs the supervisor owns): they survive the worker's
    death, not the host's, so a crash or hang costs at most interval_steps steps of work."""

    interval_steps: Interval = Field("auto", description="A memory checkpoint every N steps (skipped while the "
                                     "previous one is still being written); 0 disables the tier. auto: the interval "
                                     "that loses the least time, from what a save costs and how often the job is "
                                     "disrupted (docs/architecture.md, \"Checkpoint intervals\").")
    max_overhead: float = Field(0.05, gt=0, le=1, description="The most of the training time the tier's saves "
                                "may hold the loop: a save is skipped while they have taken more.")
    min_interval_steps: PositiveInt = Field(1, description="auto never saves more often than this.")
    max_interval_seconds: float = Field(600.0, gt=0, description="auto never leaves more training time than this "
                                        "between saves.")


class CheckpointConfig(Section):
    dir: str | None = Field(None, description="Local root; default <state>/checkpoints. Layout <dir>/<job>/step_N.")
    interval_steps: Interval = Field(0, description="Checkpoint every N steps; 0 disables. auto: the interval "
                                     "that loses the least time, as checkpoint.memory's auto (its bounds below).")
    interval_seconds: float = Field(0, ge=0, description="Checkpoint when this long has passed since the last; 0 disables.")
    min_interval_steps: PositiveInt = Field(1, description="interval_steps auto never saves more often than this.")
    max_interval_seconds: float = Field(3600.0, gt=0, description="interval_steps auto never leaves more training "
                                        "time than this between saves.")
    max_overhead: float = Field(0.05, gt=0, le=1, description="interval_steps auto: the most of the training time "
                                "the saves may hold the loop.")
    disruptions_per_hour: float = Field(
        1.0, gt=0, description="The disruption rate (crashes, hangs, preemptions, lost hosts) the auto intervals "
        "assume before any is seen; the supervisor then weighs in those it sees for the job on this host.")
    async_: bool = Field(True, alias="async", description="Write in the background; the loop blocks only "
                         "while the state is copied to host memory. At most one save is in flight.")
    keep: int = Field(3, ge=2, description="Committed steps kept per tier; the newest is never deleted.")
    memory: MemoryTierConfig | None = Field(
        MemoryTierConfig(), description="The memory tier, on by default where the supervisor's memory budget "
        "holds two states (tpud.yaml memory_tier_max_share); null disables it. Set explicitly, a job whose "
        "states do not fit is refused. Not used by `python -m engine.train` alone, nor under torch_xla yet.")
    remote: str | None = Field(
        None, pattern=r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?$",
        description="GCS tier, gs://bucket[/prefix]: the daemon uploads each committed step to "
        "<remote>/<job>/step_N (manifest last), keeps `keep` steps there too, and downloads the newest "
        "one before starting a worker on a host that lacks it.",
    )
    remote_interval_seconds: SecondsInterval = Field(
        0.0, description="How often the GCS tier uploads: 0, every committed local step (newest wins while one "
        "uploads); N, the newest committed step once N seconds have passed since the last upload began; auto, "
        "the interval that loses the least time from what an upload takes and how often the job is disrupted, "
        "within max_overhead and max_interval_seconds. A final, requested or preemption checkpoint is uploaded "
        "at once, whatever the interval.")
    allow_spec_changes: list[str] = Field(
        [], description="A job on several hosts resumes a checkpoint only with the job spec it was made with, "
        f"but for {', '.join(RESUMABLE)}. Keys or sections listed here may differ too, e.g. [optimizer.lr, "
        "scheduler].",
    )

    @model_validator(mode="after")
    def _spec_keys(self) -> CheckpointConfig:
        _located(type(self).__name__, [
            (("allow_spec_changes", i), key, "is not a key or section of a job spec", {})
            for i, key in enumerate(self.allow_spec_changes) if not _names_a_key(JobSpec, key)])
        return self


class RestartConfig(Section):
    """How the supervisor restarts a crashed worker (exit codes other than 0, 75, 76, 77, 78)."""

    max_restarts: int = Field(5, ge=0, description="Crash restarts allowed within window_seconds; then FAILED.")
    window_seconds: float = Field(3600.0, gt=0)
    backoff_initial_seconds: float = Field(
        1.0, ge=0, description="First delay; doubles with each further crash until a worker commits a checkpoint.")
    backoff_max_seconds: float = Field(300.0, ge=0)
    standby: bool = Field(
        True, description="Fork workers from the daemon's fork server, which imports torch and the engine once: "
        "a start or restart then skips the seconds of imports. false: each worker imports for itself.")


class SpikeConfig(Section):
    """Loss spikes (docs/architecture.md, "Healing"): a step whose loss or gradient norm stands far
    above the recent steps' is rolled back in the worker, its batches skipped and recorded."""

    window_steps: int = Field(64, ge=8, description="Steps of history: the median and the spread (median "
                              "absolute deviation) of the log loss and log gradient norm are over these.")
    warmup_steps: NonNegativeInt = Field(100, description="No spike is called before this step of the run (the "
                                         "loss falls fast at first), nor before window_steps / 4 steps of "
                                         "history after each start.")
    threshold: float = Field(6.0, gt=0, description="A spike stands this many robust standard deviations "
                             "(1.4826 x the median absolute deviation) above the window's median...")
    loss_ratio: float = Field(1.25, gt=1, description="...and its loss is at least this many times the median...")
    grad_norm_ratio: float = Field(10.0, gt=1, description="...or its gradient norm this many times (small "
                                   "batches' norms swing 5x and train on).")
    skip_steps: PositiveInt = Field(1, description="A spike at step S restores a state from step S - skip_steps "
                                    "or earlier and skips the batches of steps S - skip_steps + 1 .. S.")
    replay: bool = Field(True, description="Before skipping, replay the steps from the restored state: a spike "
                         "that does not come back was the hardware's (reported, nothing skipped), one that does "
                         "is the data's.")


class ReplicaConfig(Section):
    """Silent data corruption (docs/architecture.md, "Healing"): data-parallel replicas hold the same
    state after every step; they compare a fingerprint of it (8 bytes each)."""

    interval_steps: PositiveInt = Field(100, description="Compare every N steps, and before every disk save of a "
                                        "job with replicas (several processes or hosts, not sharded across them).")


class StragglerConfig(Section):
    """Stragglers (docs/architecture.md, "Healing"): every step each process's forward time against
    the median of the others' (one float each, all-gathered)."""

    factor: float = Field(1.5, gt=1, description="A process whose forward pass takes a median this many times the "
                          "others' at the same step (less 3 % for timing noise) ...")
    steps: PositiveInt = Field(20, description="... over the last this many steps, for a tenth of them in a row, is "
                               "flagged a straggler; under a quarter of the way from 1 to the factor it is cleared.")
    evict: bool = Field(False, description="Evict a flagged straggler: every process saves, the straggler exits 79 "
                        "(FAILED on its host, like a quarantined replica) and the others 77 (the gang goes on without "
                        "it where tpud.yaml's gang.min_hosts allows, else waits for a replacement host).")


class HealthConfig(Section):
    """How the supervisor judges a worker (docs/architecture.md, "Job lifecycle": hang, crash, non-finite loss)."""

    heartbeat_timeout_seconds: float = Field(
        60.0, gt=0, description="A worker silent for longer than this and hang_step_multiple x the median step "
        "time is hung: SIGTERM, then SIGKILL after kill_grace_seconds, then restart and resume.")
    hang_step_multiple: float = Field(10.0, gt=0, description="Slow steps are not hangs: see heartbeat_timeout_seconds.")
    startup_timeout_seconds: float = Field(
        900.0, gt=0, description="Allowance until the first startup_steps steps are done (restore, compilation).")
    startup_steps: PositiveInt = Field(2, description="Steps after each start that get the startup allowance.")
    checkpoint_timeout_seconds: float = Field(
        600.0, gt=0, description="Allowance while the training loop waits for a checkpoint to be written.")
    kill_grace_seconds: float = Field(15.0, ge=0, description="From SIGTERM to SIGKILL for a hung worker.")
    nonfinite: Literal["rollback", "stop"] = Field(
        "rollback", description="On a NaN/inf loss: rollback = restore a state from before the bad step in the "
        "worker (the memory tier, else disk; with none, a restart from the beginning) and skip its batches, as "
        "for a spike; stop = exit 76 and FAILED.")
    spikes: SpikeConfig | None = Field(SpikeConfig(), description="Loss-spike rollback; null disables it.")
    replicas: ReplicaConfig | None = Field(ReplicaConfig(), description="The replicas' fingerprint comparison; "
                                           "null disables it.")
    stragglers: StragglerConfig | None = Field(StragglerConfig(), description="Straggler detection in a job of "
                                               "several processes or hosts; null disables it.")
    max_rollbacks: NonNegativeInt = Field(3, description="Rollbacks (spikes and non-finite losses) allowed within "
                                          "rollback_window_steps steps; the next one fails the job (exit 76).")
    rollback_window_steps: PositiveInt = Field(1000, description="The window max_rollbacks counts in.")


def _names_a_key(model: type[BaseModel] | None, dotted: str) -> bool:
    """Whether `dotted` names a key or section of `model`, as job files spell them."""
    for part in dotted.split("."):
        fields = {field.alias or name: field for name, field in model.model_fields.items()} if model else {}
        if part not in fields:
            return False
        annotation = fields[part].annotation
        model = next((t for t in (annotation, *get_args(annotation))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
    return True


def _as_list(value: object) -> object:
    return [value] if isinstance(value, int) else value


Steps = Annotated[list[NonNegativeInt], BeforeValidator(_as_list)]


class BitFlip(Section):
    """One bit of one parameter of one process flipped right after a step: silent data corruption."""

    step: PositiveInt
    rank: NonNegativeInt = Field(1, description="The process (with several hosts: the host) whose copy flips.")
    tensor: str | None = Field(None, description="The parameter, by its name in the model; default the first.")
    element: NonNegativeInt = Field(0, description="Its element, in row-major order (modulo its size).")
    bit: int = Field(22, ge=0, le=31, description="The bit of the element's 32-bit pattern: 22, the mantissa's "
                     "highest, changes the value by up to half, silently; 23-30 (the exponent) may blow it up.")
    gradient: bool = Field(False, description="Flip the parameter's gradient of step `step` instead (as the optimizer "
                           "gets it: after the replicas' all-reduce), so that only this process's update is wrong.")


class HostSpike(Section):
    """One process's (with several hosts: the host's) loss of one step made 10x, once: a transient
    hardware fault, which a replay of the step does not meet again."""

    step: PositiveInt = Field(description="The step (as logged: the N-th optimizer step).")
    rank: NonNegativeInt = Field(description="The process (with several hosts: the host).")


class SlowHost(Section):
    """One process (with several hosts: the host) made slower from a step on: a straggler."""

    rank: NonNegativeInt = Field(1, description="The process (with several hosts: the host) slowed down.")
    factor: float = Field(1.5, gt=1, description="Its forward and backward passes take this many times as long "
                          "(it sleeps the difference).")
    from_step: NonNegativeInt = Field(0, description="From this step on (steps done).")


class InjectConfig(Section):
    """Faults for tests and drills. A daemon refuses jobs carrying them unless its settings
    say allow_fault_injection: true. Steps are as logged: step N is the N-th optimizer step."""

    hang_at_step: Steps = Field([], description="Hang (ignoring SIGTERM) right after step N completes.")
    crash_at_step: Steps = Field([], description="Raise an exception right after step N completes.")
    nan_at_step: Steps = Field([], description="The loss of step N is NaN (its batch is poisoned).")
    spike_at_step: Steps = Field([], description="The loss of step N is 10x (its batch is poisoned): a spike that "
                                 "comes back on replay, as bad data's does.")
    bit_flips: list[BitFlip] = Field([], description="Bits flipped in one process's parameters after a step, or in "
                                     "its gradients before the update.")
    slow_host: SlowHost | None = Field(None, description="One process slowed down by a factor: a straggler.")
    host_spikes: list[HostSpike] = Field([], description="One process's loss of a step made 10x once, not on its "
                                         "replay: a hardware fault the spike detector finds and, with replicas, names.")
    address_space_mib: PositiveInt | None = Field(
        None, description="Every worker limits its own address space (RLIMIT_AS) to its size at start plus this "
        "many MiB before it builds the model: a real allocation failure, for the micro-batch fitting tests.")
    repeat: bool = Field(
        False, description="Fire in every worker that reaches the step (a deterministic fault); by default each "
        "fault fires once per job, as transient faults do. A bit flip never fires again in an in-place replay of its "
        "step (a replica check's).")


class DebugConfig(Section):
    inject: InjectConfig | None = None


class WandbConfig(Section):
    """Weights & Biases, logged by the supervisor from the host-side step metrics (rank 0 only)."""

    project: str
    entity: str | None = None
    name: str | None = Field(None, description="Display name; default: the job name.")
    group: str | None = None
    tags: list[str] = []
    mode: Literal["online", "offline"] = Field("online", description="offline writes runs under <state>/jobs/<job>/wandb.")


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    wandb: WandbConfig | None = Field(None, description="Off unless set.")
    tensorboard: str | None = Field(
        None, description="A directory, local or gs://bucket/prefix, where the daemon of the job's first host "
        "writes its TensorBoard event files, under <directory>/<job>/: the step's scalars as wandb's tags, the "
        "validation loss, goodput and badput; a resumed run's curves go on from the step it restored (what was "
        "logged after it is purged). Off unless set.")

    @model_validator(mode="after")
    def _a_directory(self) -> LoggingConfig:
        value = self.tensorboard
        if value is None:
            return self
        if value.startswith("gs:"):
            wrong = None if _GCS_URL.match(value) else "must be gs://bucket[/prefix]"
        else:
            wrong = None if value.strip() and "\0" not in value else "must name a directory"
        if wrong:
            raise ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(
                type=PydanticCustomError("directory", wrong), loc=("tensorboard",), input=value)])
        return self


class JobSpec(Section):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$", description="Job name: lowercase, digits, . _ -")
    model: ModelConfig = ModelConfig()
    attention: AttentionConfig = AttentionConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    loss: LossConfig = LossConfig()
    device: DeviceConfig = DeviceConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    restart: RestartConfig = RestartConfig()
    health: HealthConfig = HealthConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig | None = Field(None, description="Off unless set.")
    distill: DistillConfig | None = Field(None, description="Off unless set.")
    debug: DebugConfig = DebugConfig()

    @model_validator(mode="after")
    def _cross_section(self) -> JobSpec:
        # A plain ValueError here would be reported against the spec as a whole (empty loc).
        # pydantic-core passes a ValidationError raised by a validator through with its locs,
        # so each problem names the key to change, e.g. data.seq_len, and all are reported.
        problems: list[InitErrorDetails] = []

        def problem(loc: tuple[str, str], value: object, message: str, **ctx: object) -> None:
            error = PydanticCustomError("cross_section", message, ctx)
            problems.append(InitErrorDetails(type=error, loc=loc, input=value))

        if self.data.seq_len > self.model.max_seq_len:
            problem(
                ("data", "seq_len"), self.data.seq_len,
                "must not exceed model.max_seq_len ({max_seq_len})", max_seq_len=self.model.max_seq_len,
            )
        moe, mesh = self.model.moe, self.device.mesh
        if self.device.processes_per_host not in ("auto", 1) and self.device.backend == "xla":
            problem(("device", "processes_per_host"), self.device.processes_per_host, "must be 1 or auto on xla: one "
                    "process drives every local chip (SPMD)")
        if moe is not None and moe.capacity_factor is None and self.device.backend == "xla":
            problem(("model", "moe", "capacity_factor"), None, "must be set on the xla backend: XLA compiles "
                    "static shapes, so each expert gets a fixed number of seats (1.25 is usual; num_experts / "
                    "top_k drops nothing)")
        if mesh.expert != 1 and self.device.backend in ("cpu", "cuda"):
            problem(("device", "mesh", "expert"), mesh.expert, "must be 1 on the {backend} backend: expert "
                    "parallelism is an xla mesh axis (cpu and cuda shard experts with fsdp)",
                    backend=self.device.backend)
        elif mesh.expert > 1 and (moe is None or moe.num_experts % mesh.expert):
            problem(("device", "mesh", "expert"), mesh.expert, "must divide model.moe.num_experts ({experts})",
                    experts=None if moe is None else moe.num_experts)
        if self.data.micro_batch_size == "auto" and self.train.global_batch_size is None:
            problem(("data", "micro_batch_size"), "auto", "auto needs train.global_batch_size (auto divides that "
                    "batch into the largest micro-batches that fit)")
        if self.eval is not None and not self.data.datasets:
            problem(("eval",), "eval", "needs data.dataset or data.mixture: the built-in corpus has no "
                    "validation split")
        self._distill_problems(problem)
        if self.scheduler.warmup_steps >= self.train.max_steps:
            problem(
                ("scheduler", "warmup_steps"), self.scheduler.warmup_steps,
                "must be below train.max_steps ({max_steps})", max_steps=self.train.max_steps,
            )
        elif self.scheduler.name == "wsd":
            decay = max(1, round(self.scheduler.decay_fraction * self.train.max_steps))
            if decay > self.train.max_steps - self.scheduler.warmup_steps:
                problem(
                    ("scheduler", "decay_fraction"), self.scheduler.decay_fraction,
                    "decays over {decay} steps, more than the {stable} left after warmup",
                    decay=decay, stable=self.train.max_steps - self.scheduler.warmup_steps,
                )
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        return self

    def _distill_problems(self, problem) -> None:
        """What distillation asks of the other sections."""
        if self.distill is not None and self.distill.offline and not self.data.datasets:
            problem(("distill", "teacher"), "offline", "needs data.dataset or data.mixture prepared with --teacher: "
                    "the built-in corpus carries no teacher")
        if self.distill is not None and self.distill.hidden is not None:
            for student, _ in self.distill.hidden.layers:
                if student > self.model.n_layers:
                    problem(("distill", "hidden", "layers"), student, "names a student block past model.n_layers "
                            "({n_layers})", n_layers=self.model.n_layers)
                    break
        if self.distill is not None:
            loss = self.loss
            for key, default in (("label_smoothing", 0.0), ("z_loss", 0.0), ("softcap", None), ("focal_gamma", 0.0)):
                if getattr(loss, key) != default:
                    problem(("loss", key), getattr(loss, key), "does not apply to distillation's loss "
                            "(distill.alpha weighs a plain cross-entropy); leave it out")

