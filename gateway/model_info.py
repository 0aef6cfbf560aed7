"""What the gateway knows about the served model: tokenizer, context length, sampling defaults.

The gateway never loads weights, nor transformers or torch (a replica starts in about a second
and idles small): it reads the same config files the engine reads, as JSON through the engine's
own checks (`engine.hf_config.read_hf_config`), so that "max_model_len" and the
generation-config defaults mean the same thing on both sides of the gRPC boundary; the tokenizer
is `engine.light_tokenizer.LightTokenizer`, held to transformers' results by its tests. A folder
whose tokenizer it cannot reproduce (remote code, a sentencepiece-only or model-specific class)
falls back to transformers, with a warning: that replica then pays for torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.hf_config import load_generation_config, read_hf_config
from engine.light_tokenizer import LightTokenizer
from engine.tokenizer_files import load_tokenizer_light_first
from engine.weights.hub import resolve_model_path
from gateway.config import GatewaySettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# The engine's fallback when a config has no max_position_embeddings.
_DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class ModelInfo:
    served_model_names: tuple[str, ...]
    root: str  # the model argument as given (vLLM's `root`)
    tokenizer: LightTokenizer | PreTrainedTokenizerBase
    max_model_len: int
    vocab_size: int
    generation_config: dict[str, Any]
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        return self.served_model_names[0]

    def is_served(self, model: str | None) -> bool:
        """vLLM accepts a missing `model` as "the served one"."""
        return model is None or model in self.served_model_names


def load_model_info(settings: GatewaySettings) -> ModelInfo:
    path = resolve_model_path(settings.model)
    hf_config = read_hf_config(path)
    derived_len = getattr(hf_config, "max_position_embeddings", None) or _DEFAULT_MAX_MODEL_LEN
    max_model_len = settings.max_model_len or derived_len
    if max_model_len > derived_len:
        # Same rule as EngineConfig.from_args, so gateway and decode cannot disagree silently.
        raise ValueError(
            f"User-specified max_model_len ({max_model_len}) is greater than the derived "
            f"max_model_len (max_position_embeddings={derived_len} in the model's config.json). "
            "Lower max_model_len."
        )
    tokenizer = load_tokenizer_light_first(path, settings.trust_remote_code)
    logger.info(
        "serving %s from %s (max_model_len=%d)", settings.served_model_name, path, max_model_len
    )
    return ModelInfo(
        served_model_names=tuple(settings.served_model_name),
        root=settings.model,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        vocab_size=hf_config.vocab_size,
        generation_config=load_generation_config(path),
    )
