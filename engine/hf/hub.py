"""Models by Hugging Face Hub id: `org/name` or `org/name@revision` wherever a model directory is
taken (`model.init_from`, `distill.teacher`, `tpud prepare --tokenizer`). Torch-free.

A value is a hub id when it has that form and names nothing on disk (relative to the job file).
huggingface_hub resolves it with its own cache and settings: HF_HOME / HF_HUB_CACHE, HF_TOKEN for
gated models, HF_HUB_OFFLINE=1 on a machine with a warm cache or a mirror (HF_ENDPOINT). The job
loader reads config.json alone (what validation needs); the worker fetches the model's weights
and tokenizer files, once per cache, and reads them from the snapshot directory.
"""

from __future__ import annotations

import re
from pathlib import Path

_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
# What a model directory needs of a repository (never its other formats: .bin, .gguf, onnx/).
FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
         "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
         "chat_template.jinja"]


class HubError(ValueError):
    """The hub id cannot be resolved; the message says why (not found, offline and not cached, ...)."""


def parse(value: str) -> tuple[str, str | None] | None:
    """(repository, revision) when `value` has a hub id's form, else None."""
    match = _ID.match(value)
    return (match["repo"], match["revision"]) if match else None


def is_hub_id(value: str, base: Path) -> bool:
    """Whether `value` names a hub model: a hub id's form, and no such path under `base`."""
    return parse(value) is not None and not (base / value).exists()


def config_file(value: str) -> Path:
    """The model's config.json, from the cache or downloaded."""
    from huggingface_hub import hf_hub_download

    repo, revision = parse(value)
    return Path(_call(value, hf_hub_download, repo, "config.json", revision=revision))


def snapshot(value: str) -> Path:
    """A local directory holding the model's config, weights and tokenizer files."""
    from huggingface_hub import snapshot_download

    repo, revision = parse(value)
    return Path(_call(value, snapshot_download, repo, revision=revision, allow_patterns=FILES))


def tokenizer(value: str) -> Path:
    """A local directory holding the model's tokenizer files alone (`tpud prepare --tokenizer ID`)."""
    from huggingface_hub import snapshot_download

    repo, revision = parse(value)
    return Path(_call(value, snapshot_download, repo, revision=revision, allow_patterns=FILES[4:]))


def _call(value: str, fn, *args, **kwargs):
    from huggingface_hub import errors

    try:
        return fn(*args, **kwargs)
    except errors.RepositoryNotFoundError:
        raise HubError(f"{value}: no such model on the Hugging Face Hub (or it is gated: set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{value}: no such revision") from None
    except errors.LocalEntryNotFoundError:
        raise HubError(f"{value}: not in the Hugging Face cache, and the Hub cannot be reached (HF_HUB_OFFLINE "
                       "is set, or the network is down)") from None
    except (errors.HfHubHTTPError, OSError, ValueError) as e:
        raise HubError(f"{value}: {e}") from None
