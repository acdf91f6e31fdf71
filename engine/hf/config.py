"""A Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE config.json as the engine's model section, and
back. Torch-free.

`model.init_from` names a Hugging Face model directory (local, gs://, or a hub id: engine.hf.hub);
its config.json decides the model's
geometry. The job may leave the dimensions out (they are filled in from config.json) or write
them out (each must then equal config.json's). Both the published format (top-level
`rope_theta` and `rope_scaling`, Llama 3.1) and transformers 5's (`rope_parameters`) are read;
`config_json` writes the published format, which every transformers version and the tools
built on it (vLLM, llama.cpp's converter) read. Which family an engine model exports as follows
from its shape (`family`): Qwen3 has qk_norm, the MoE ones have experts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.files import Refused, read_regular_file
from engine.hf import hub

if TYPE_CHECKING:
    from engine.spec.schema import ModelConfig

# ModelConfig key -> config.json key
FIELDS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
    "rope_scaling": "rope_scaling",
    "moe": "num_local_experts/num_experts_per_tok/router_aux_loss_coef",
    "head_size": "head_dim",
    "qk_norm": "model_type qwen3",
}
# Keys of a config.json section that are training choices, not the model's shape: a job may set its own.
CHOSEN_BY_THE_JOB = {"router_aux_loss_coef", "router_z_loss_coef", "capacity_factor"}
LLAMA_TYPES = {"llama", "mixtral", "qwen3", "qwen3_moe"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
MAX_CONFIG_BYTES = 1 << 20


class HfConfigError(ValueError):
    """A config.json that is not a Llama model the engine can load."""


def model_fields(directory: str | Path) -> dict:
    """The ModelConfig values config.json in `directory` implies; HfConfigError naming the problem."""
    path, config = _read_config(str(directory))
    kind = config.get("model_type")
    _refuse_what_the_engine_lacks(path, config, kind)
    fields = {ours: config[theirs] for ours, theirs in FIELDS.items() if theirs in config}
    if (moe := _moe_fields(kind, config)) is not None:
        fields["moe"] = moe
    if kind in ("qwen3", "qwen3_moe"):
        fields["qk_norm"] = True
    theta, scaling = _rope(path, config)
    fields.update(rope_theta=theta, rope_scaling=scaling)
    fields.setdefault("n_kv_heads", fields.get("n_heads"))
    fields.setdefault("tie_embeddings", False)  # transformers' LlamaConfig default
    head_dim = config.get("head_dim")
    if head_dim is not None and not (fields.get("dim") and fields.get("n_heads") and head_dim * fields["n_heads"] == fields["dim"]):
        fields["head_size"] = head_dim  # Qwen3's heads are not hidden_size / heads wide
    return fields


def _read_config(directory: str) -> tuple[str, dict]:
    """(config.json's path, its object), from a local or gs:// model directory."""
    path = f"{directory.rstrip('/')}/config.json"
    try:
        if directory.startswith("gs://"):
            from engine.hf import remote

            text = remote.read_config(directory, MAX_CONFIG_BYTES)
        elif hub.parse(directory) is not None and not Path(directory).is_absolute():
            text = read_regular_file(hub.config_file(directory), limit=MAX_CONFIG_BYTES)
        else:
            text = read_regular_file(Path(path), limit=MAX_CONFIG_BYTES)
        config = json.loads(text)
    except FileNotFoundError:
        raise HfConfigError(f"{directory}: no config.json (expected a Hugging Face model directory)") from None
    except hub.HubError as e:
        raise HfConfigError(str(e)) from None
    except Exception as e:  # OSError, ValueError, Refused, or GCS unreachable: the message says which
        raise HfConfigError(f"{path}: unreadable: {e}") from None
    if not isinstance(config, dict):
        raise HfConfigError(f"{path}: not a JSON object")
    return path, config


def _refuse_what_the_engine_lacks(path: str, config: dict, kind: str | None) -> None:
    if kind not in LLAMA_TYPES:
        raise HfConfigError(f"{path}: model_type {kind!r} is not a Llama model (architectures: "
                            f"{config.get('architectures')}); only the Llama family loads")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise HfConfigError(f"{path}: {flag} is true; the engine's Llama has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise HfConfigError(f"{path}: hidden_act {config['hidden_act']!r}; the engine's SwiGLU uses silu")
    if kind == "mixtral":
        for key in ("sliding_window", "router_jitter_noise"):
            if config.get(key):
                raise HfConfigError(f"{path}: {key} is {config[key]!r}; the engine's Mixtral has none")
    if kind in ("qwen3", "qwen3_moe"):
        if config.get("use_sliding_window"):
            raise HfConfigError(f"{path}: use_sliding_window is true; the engine's Qwen3 attends over the whole window")
    if kind == "qwen3_moe":
        if config.get("mlp_only_layers"):
            raise HfConfigError(f"{path}: mlp_only_layers is {config['mlp_only_layers']!r}; the engine's Qwen3-MoE "
                                "has experts in every layer")
        if config.get("decoder_sparse_step", 1) != 1:
            raise HfConfigError(f"{path}: decoder_sparse_step is {config['decoder_sparse_step']!r}; the engine's "
                                "Qwen3-MoE has experts in every layer (1)")


def _rope(path: str, config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either form transformers writes (rope_parameters in 5.x)."""
    rope = dict(config.get("rope_parameters") or {})
    theta = config.get("rope_theta", rope.pop("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        rope_type = scaling.pop("type", None) or scaling.get("rope_type")
        if rope_type != "llama3":
            raise HfConfigError(f"{path}: rope scaling {rope_type!r} is not supported (only llama3)")
        scaling["rope_type"] = rope_type
    return theta, scaling


def _moe_fields(kind: str, config: dict) -> dict | None:
    if kind == "mixtral":
        # Mixtral always renormalises the top k; intermediate_size is the experts' (ffn_dim, their default).
        return {"num_experts": config.get("num_local_experts", 8), "top_k": config.get("num_experts_per_tok", 2),
                "norm_topk_prob": True, "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.001)}
    if kind == "qwen3_moe":
        # The published configs say num_experts; transformers 5 writes num_local_experts.
        return {"num_experts": config.get("num_experts", config.get("num_local_experts", 128)),
                "top_k": config.get("num_experts_per_tok", 8),
                "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
                "expert_ffn_dim": config.get("moe_intermediate_size", 768),
                "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.001)}
    return None


def family(model: ModelConfig) -> str:
    """The Hugging Face model_type an engine model exports as."""
    if model.qk_norm:
        return "qwen3_moe" if model.moe is not None else "qwen3"
    return "mixtral" if model.moe is not None else "llama"


def config_json(model: ModelConfig, dtype: str, bos: int | None, eos: int | None) -> dict:
    """config.json for the model's `family` (LlamaForCausalLM, MixtralForCausalLM, Qwen3ForCausalLM,
    Qwen3MoeForCausalLM) with the engine model's geometry; dtype "bfloat16" or "float32"."""
    kind = family(model)
    config = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        **{theirs: getattr(model, ours) for ours, theirs in FIELDS.items()
           if ours not in ("n_kv_heads", "ffn_dim", "moe", "head_size", "qk_norm")},
        "num_key_value_heads": model.kv_heads,
        "intermediate_size": model.hidden_dim,
        "head_dim": model.head_dim,
        "rope_scaling": model.rope_scaling.model_dump() if model.rope_scaling else None,
        "max_position_embeddings": model.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.init_std,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if kind == "mixtral":
        config.update(_mixtral(model))
    elif kind == "qwen3_moe":
        moe = model.moe
        config.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk_prob,
                      moe_intermediate_size=model.expert_dim, router_aux_loss_coef=moe.router_aux_loss_coef,
                      decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    if kind in ("qwen3", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=model.n_layers)
    return {**config, **{k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None}}


def _mixtral(model: ModelConfig) -> dict:
    """What makes config.json a Mixtral's; HfConfigError for experts Mixtral cannot express."""
    moe = model.moe
    assert moe is not None
    if not moe.norm_topk_prob:
        raise HfConfigError("model.moe.norm_topk_prob is false; Mixtral always renormalises the top k")
    return {"intermediate_size": model.expert_dim,
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.router_aux_loss_coef, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None}


def same(ours: object, theirs: object) -> bool:
    """Whether a job's value equals config.json's (numbers compared as numbers)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(same(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and not isinstance(ours, bool):
        return float(ours) == float(theirs)
    return ours == theirs
