"""A model folder's config files. The engine reads them through transformers; the gateway,
which must not import transformers (it imports torch), reads the same JSON.

`check_hf_config` is the one check of `config.json` (supported architecture, positive sizes) for
engine and gateway alike, so both derive `max_model_len` from the same numbers: the gateway's
`read_hf_config` fills a missing field with the default of transformers' config class, as
`AutoConfig` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
_CHECKED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Defaults of LlamaConfig / Qwen3Config (transformers 5) for the fields serving reads.
_CLASS_DEFAULTS: dict[str, dict[str, int]] = {
    "llama": dict(max_position_embeddings=2048, vocab_size=32000, hidden_size=4096,
                  num_hidden_layers=32, num_attention_heads=32),
    "qwen3": dict(max_position_embeddings=32768, vocab_size=151936, hidden_size=4096,
                  num_hidden_layers=32, num_attention_heads=32),
}  # fmt: skip


def check_hf_config(path: Path, config: Any) -> None:
    """`config` (a PretrainedConfig, or a `read_hf_config` namespace) is one we can serve."""
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"Model architectures {archs} are not supported. Supported architectures: "
            f"{list(SUPPORTED_ARCHITECTURES)}."
        )
    for name in _CHECKED_FIELDS:
        value = getattr(config, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"Malformed model config at {path}: `{name}` must be a positive integer, "
                f"got {value!r}."
            )


def read_hf_config(path: Path) -> SimpleNamespace:
    """`config.json` as plain JSON (no transformers), checked like `load_hf_config`."""
    config_path = Path(path) / "config.json"
    try:
        with open(config_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"Malformed model config at {config_path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"Malformed model config at {config_path}: not a JSON object")
    defaults = _CLASS_DEFAULTS.get(data.get("model_type"), {})
    config = SimpleNamespace(**{**defaults, **data})
    check_hf_config(Path(path), config)
    return config


def load_hf_config(path: Path) -> PretrainedConfig:
    """Load and check `config.json`, with errors that say what is wrong and what to do."""
    # Imported here: importing transformers' config classes imports torch when it is installed.
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"Malformed model config at {path / 'config.json'}: {e}") from e
    check_hf_config(path, hf_config)
    return hf_config


def load_generation_config(path: Path) -> dict[str, Any]:
    gen_path = path / "generation_config.json"
    if not gen_path.exists():
        return {}
    with open(gen_path) as f:
        return json.load(f)
