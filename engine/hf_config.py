"""A model folder's config files, read without torch: the gateway reads them too.

`load_hf_config` is the one check of `config.json` (supported architecture, positive sizes) for
engine and gateway alike, so both derive `max_model_len` from the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")


def load_hf_config(path: Path) -> PretrainedConfig:
    """Load and check `config.json`, with errors that say what is wrong and what to do."""
    # Imported here: importing transformers' config classes imports torch when it is installed.
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"Malformed model config at {path / 'config.json'}: {e}") from e
    archs = getattr(hf_config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"Model architectures {archs} are not supported. Supported architectures: "
            f"{list(SUPPORTED_ARCHITECTURES)}."
        )
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        value = getattr(hf_config, name, None)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"Malformed model config at {path}: `{name}` must be a positive integer, "
                f"got {value!r}."
            )
    return hf_config


def load_generation_config(path: Path) -> dict[str, Any]:
    gen_path = path / "generation_config.json"
    if not gen_path.exists():
        return {}
    with open(gen_path) as f:
        return json.load(f)
