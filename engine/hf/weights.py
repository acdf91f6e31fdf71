"""Hugging Face Llama, Mixtral, Qwen3 and Qwen3-MoE weights (safetensors, single or sharded) into the
engine's Transformer.

The engine's layout is Hugging Face's apart from names: both rotate the half-split pairs of
each head (`rotate_half`), so q and k need no permutation. Files are memory-mapped and read
one tensor at a time (`hf_values`), which the backend places where the parameter lives
(sharded under SPMD): beyond the model itself, host memory holds about one tensor. The experts
of a mixture are one tensor per expert there (what save_pretrained writes: Mixtral's w1/w3/w2,
Qwen3-MoE's gate/up/down_proj) and one [experts, ...] tensor per layer here: their slices are
gathered until the layer's tensor is whole. transformers 5 holds them fused in memory
(experts.gate_up_proj [experts, 2 x hidden, dim], gate first, and experts.down_proj), and a
file written from that state holds those: each is split or taken whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch

from engine.errors import ConfigError
from engine.models.llama import Transformer

log = structlog.get_logger()

INDEX = "model.safetensors.index.json"
_BLOCK = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
    "block_sparse_moe.gate": "moe.router", "mlp.gate": "moe.router",  # Mixtral's; Qwen3-MoE's (and transformers 5's)
}
_HF_BLOCK = {ours: theirs for theirs, ours in _BLOCK.items() if ours != "moe.router"}
_ROUTER = {"mixtral": "block_sparse_moe.gate", "qwen3_moe": "mlp.gate"}
# Each family's name of an expert's three matrices (engine w1, w3, w2: gate, up, down).
_EXPERT_WEIGHTS = {"mixtral": ("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
                   "qwen3_moe": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})}
_FROM_HF_EXPERT = {"w1": "w1", "w3": "w3", "w2": "w2", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w[123]|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
# Buffers some exporters include; derived from the config, never loaded.
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


def hf_name(name: str, family: str = "llama") -> str:
    """The Hugging Face tensor name of an engine parameter in a model of `family` (engine.hf.config's;
    the inverse of `engine_name`)."""
    fixed = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    _, index, rest = name.split(".", 2)
    module = rest.removesuffix(".weight")
    return f"model.layers.{index}.{_ROUTER[family] if module == 'moe.router' else _HF_BLOCK[module]}.weight"


def hf_expert_name(name: str, expert: int, family: str = "mixtral") -> str:
    """The Hugging Face name of one expert's slice of an engine expert tensor (layers.N.moe.wK)."""
    _, index, _, weight = name.split(".")
    block, names = _EXPERT_WEIGHTS[family]
    return f"model.layers.{index}.{block}.experts.{expert}.{names[weight]}.weight"


def expert_slice(hf_name: str) -> tuple[str, int] | None:
    """The engine expert tensor and the expert a Hugging Face per-expert name stands for; None for others."""
    match = _EXPERT.match(hf_name)
    return (f"layers.{match[1]}.moe.{_FROM_HF_EXPERT[match[3]]}", int(match[2])) if match else None


def fused_experts(hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """A transformers 5 fused expert tensor as the engine tensors it holds; None for other names."""
    match = _FUSED.match(hf_name)
    if not match:
        return None
    layer = f"layers.{match[1]}.moe"
    if match[2] == "down_proj":
        return [(f"{layer}.w2", tensor)]
    gate, up = tensor.chunk(2, dim=1)
    return [(f"{layer}.w1", gate.contiguous()), (f"{layer}.w3", up.contiguous())]


def engine_name(hf_name: str) -> str | None:
    """The engine parameter a Hugging Face tensor name stands for; None for names it has no use for."""
    if hf_name == "model.embed_tokens.weight":
        return "tok_embeddings.weight"
    if hf_name == "model.norm.weight":
        return "norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    match = _LAYER.match(hf_name)
    if match and match[2] in _BLOCK:
        return f"layers.{match[1]}.{_BLOCK[match[2]]}.weight"
    return None


def _files(directory: Path, key: str) -> dict[str, list[str] | None]:
    """safetensors file -> the names the index promises in it (None: whatever it holds)."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(key, f"{index}: not a safetensors index: {e}") from None
        files: dict[str, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    single = sorted(p.name for p in directory.glob("*.safetensors"))
    if not single:
        raise ConfigError(key, f"{directory}: no *.safetensors weights")
    return dict.fromkeys(single)


def hf_values(model: Transformer, directory: str | Path, key: str = "model.init_from",
              skip: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(engine parameter name, host tensor) for each weight in the directory, read one at a time and checked
    against `model`'s shapes (it may be on meta), but those under `skip` (no Hugging Face model has them:
    engine.distill.hidden); ConfigError naming what is missing or mismatched, against the job's `key`."""
    from safetensors import SafetensorError, safe_open

    directory, loaded = Path(directory), set()
    params = {name: p for name, p in model.named_parameters() if not (skip and name.startswith(f"{skip}."))}
    # Expert tensors being gathered: the tensor and the experts it has so far.
    partial: dict[str, tuple[torch.Tensor, set[int]]] = {}
    for file, promised in _files(directory, key).items():
        path = directory / file
        if not path.is_file():
            raise ConfigError(key, f"{path}: missing (named by {INDEX})")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name_there in promised or f.keys():
                    if _FUSED.match(name_there):
                        for name, tensor in fused_experts(name_there, f.get_tensor(name_there)):
                            if name not in params or tensor.shape != params[name].shape:
                                raise ConfigError(key, f"{path}: {name_there} holds {name} of shape "
                                                  f"{list(tensor.shape)}; the model expects "
                                                  f"{list(params[name].shape) if name in params else 'no experts'}")
                            loaded.add(name)
                            yield name, tensor.to(params[name].dtype)
                        continue
                    if (found := expert_slice(name_there)) is not None and found[0] in params:
                        name, expert = found
                        shape = params[name].shape
                        tensor = f.get_tensor(name_there)
                        if expert >= shape[0] or tensor.shape != shape[1:]:
                            raise ConfigError(key, f"{path}: {name_there} has shape "
                                              f"{list(tensor.shape)}, the model expects {shape[0]} experts of "
                                              f"{list(shape[1:])}")
                        whole, have = partial.setdefault(name, (torch.empty(shape, dtype=params[name].dtype), set()))
                        whole[expert] = tensor
                        have.add(expert)
                        if len(have) == shape[0]:
                            del partial[name]
                            loaded.add(name)
                            yield name, whole
                        continue
                    name = engine_name(name_there)
                    if name is None or name not in params:
                        if name == "output.weight" and model.output is None or _IGNORED.search(name_there):
                            continue  # a tied model's copy of the embedding, or a derived buffer
                        raise ConfigError(key, f"{path}: unexpected tensor {name_there}")
                    tensor = f.get_tensor(name_there)
                    if tensor.shape != params[name].shape:
                        raise ConfigError(key, f"{path}: {name_there} has shape {list(tensor.shape)}, "
                                          f"the model expects {list(params[name].shape)}")
                    loaded.add(name)
                    yield name, tensor.to(params[name].dtype)
        except SafetensorError as e:
            raise ConfigError(key, f"{path}: unreadable safetensors file: {e}") from None
    if missing := sorted(set(params) - loaded):
        raise ConfigError(key, f"{directory}: no weights for {', '.join(missing[:5])}"
                          + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    log.info("weights loaded", key=key, directory=str(directory), tensors=len(loaded))


@torch.no_grad()
def load_weights(model: Transformer, directory: str | Path) -> None:
    """Copy the directory's weights into a model that has its own (not on the meta device)."""
    params = dict(model.named_parameters())
    for name, value in hf_values(model, directory):
        params[name].copy_(value)
