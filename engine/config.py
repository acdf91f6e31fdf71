"""The job spec: one pydantic model per section, validated once at the edge.

This module must stay importable without torch: the daemon validates job files with it
and never imports torch. Loading YAML (includes, overrides, line numbers) lives in
`engine/specfile.py`; this file only says what a valid job is.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError


class Section(BaseModel):
    # Unknown keys are errors: a typo must never silently fall back to a default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    """A Llama-family decoder. Presets live in configs/models/*.yaml."""

    vocab_size: PositiveInt = 256
    dim: PositiveInt = 128
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    n_kv_heads: PositiveInt | None = Field(None, description="Grouped-query attention; default = n_heads.")
    ffn_dim: PositiveInt | None = Field(None, description="SwiGLU hidden size; default = 8/3 dim rounded up to multiple_of.")
    multiple_of: PositiveInt = 64
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    max_seq_len: PositiveInt = 2048
    tie_embeddings: bool = True
    activation_checkpointing: bool = False
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.kv_heads > self.n_heads or self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head dim dim/n_heads = {self.head_dim} must be even for rotary embeddings")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * -(-hidden // self.multiple_of)


AttentionKernel = Literal["auto", "sdpa", "eager", "flash", "splash"]


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


class DataConfig(Section):
    corpus: Literal["stdlib"] = Field(
        "stdlib", description="stdlib: the Python standard library's source, byte-tokenized; present everywhere."
    )
    corpus_bytes: PositiveInt = Field(8_000_000, description="Upper bound on corpus size.")
    seq_len: PositiveInt = 256
    micro_batch_size: PositiveInt = Field(16, description="Sequences per micro-batch per data-parallel rank.")


class TrainConfig(Section):
    max_steps: PositiveInt = 300
    grad_accum_steps: PositiveInt = 1
    seed: int = 0
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm; 0 disables clipping.")
    log_interval: PositiveInt = 10
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto = bf16 autocast on cuda and xla, fp32 on cpu."
    )


class OptimizerConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0, description="Not applied to norms, biases and embeddings.")


class SchedulerConfig(Section):
    name: Literal["cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class LossConfig(Section):
    name: Literal["ce"] = "ce"


class MeshConfig(Section):
    """Device mesh axes for SPMD. One axis may be -1: all devices not used by the others."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    @model_validator(mode="after")
    def _one_wildcard(self) -> MeshConfig:
        sizes = (self.data, self.fsdp, self.tensor)
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError("at most one mesh axis may be -1")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError("mesh axes must be positive or -1")
        return self

    def resolve(self, num_devices: int) -> dict[str, int]:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        fixed = 1
        for s in sizes.values():
            fixed *= s if s > 0 else 1
        if num_devices % fixed:
            raise ValueError(f"mesh {sizes} does not divide {num_devices} devices")
        for axis, s in sizes.items():
            if s == -1:
                sizes[axis] = num_devices // fixed
        product = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
        if product != num_devices:
            raise ValueError(f"mesh {sizes} uses {product} devices, but {num_devices} are present")
        return sizes


class DeviceConfig(Section):
    backend: Literal["auto", "cpu", "cuda", "xla"] = Field(
        "auto", description="auto: xla on a TPU host, else cuda when present, else cpu."
    )
    mesh: MeshConfig = MeshConfig()
    compile_cache: bool = Field(True, description="Persistent XLA compilation cache under the job's state directory.")
    peak_flops: float | None = Field(
        None, gt=0, description="Peak FLOP/s per device for MFU; detected for known TPUs and GPUs."
    )


class CheckpointConfig(Section):
    dir: str | None = Field(None, description="Local root; default <state>/checkpoints. Layout <dir>/<job>/step_N.")
    interval_steps: int = Field(0, ge=0, description="0 disables periodic checkpoints.")
    keep: int = Field(3, ge=2)


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"


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
    logging: LoggingConfig = LoggingConfig()

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
        if self.scheduler.warmup_steps >= self.train.max_steps:
            problem(
                ("scheduler", "warmup_steps"), self.scheduler.warmup_steps,
                "must be below train.max_steps ({max_steps})", max_steps=self.train.max_steps,
            )
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        return self
