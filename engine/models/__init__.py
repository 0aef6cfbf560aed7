"""Model families by HF architecture name."""

from transformers import PretrainedConfig

from engine.models.base import DecoderForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(config: PretrainedConfig) -> type[DecoderForCausalLM]:
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"Model architectures {config.architectures} are not supported. "
        f"Supported architectures: {list(MODEL_REGISTRY)}."
    )
