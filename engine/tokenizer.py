"""Tokenizer loading, prompt encoding and chat templates.

Everything the engine needs from a Hugging Face tokenizer goes through these few functions, so
the rest of the engine works on token ids only. Chat prompts are rendered to a string first and
then encoded with `add_special_tokens=False` (as vLLM does): templates already contain BOS and
other specials, and adding them again would double them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers' Auto classes import torch; the gateway imports this module
    from transformers import PreTrainedTokenizerBase

    from engine.light_tokenizer import LightTokenizer

logger = logging.getLogger(__name__)

# Files that carry a vocabulary. transformers 5 silently builds an *empty* tokenizer from a
# folder that has only config.json, so we check for one of these before loading.
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _has_tokenizer_files(path: Path, trust_remote_code: bool) -> bool:
    if any((path / name).is_file() for name in _VOCAB_FILES):
        return True
    if any(path.glob("*.tiktoken")):
        return True
    # Remote-code tokenizers may name their vocabulary anything; their config is the marker.
    return trust_remote_code and (path / "tokenizer_config.json").is_file()


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the (fast) tokenizer of a local model folder, failing loudly if it has none."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} is not a directory")
    if not _has_tokenizer_files(path, trust_remote_code):
        raise FileNotFoundError(
            f"no tokenizer in {str(path)!r}: expected one of {', '.join(_VOCAB_FILES)} or a "
            "*.tiktoken file; pass a tokenizer folder explicitly if it lives elsewhere"
        )
    # Imported here: transformers' Auto classes import torch (when installed); the gateway
    # imports this module for `apply_chat_template` and must not pay for torch.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not tokenizer.is_fast:
        # Still usable (the detokenizer only needs convert_tokens_to_string), just slower.
        logger.warning("tokenizer at %s is not a fast tokenizer; detokenizing will be slow", path)
    return tokenizer


def encode_prompt(tokenizer: PreTrainedTokenizerBase | LightTokenizer, prompt: str) -> list[int]:
    """Encode a plain-text prompt, adding special tokens (e.g. BOS) as HF does by default."""
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase | LightTokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **kwargs: Any,
) -> list[int]:
    """Render `messages` with the model's (or the given) chat template and return token ids.

    Extra `kwargs` reach the template (e.g. `enable_thinking=False`, `tools=[...]`). A
    `LightTokenizer` (the gateway's) renders with engine/chat_template.py, which repeats
    transformers' rendering: the same text and ids either way.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; pass `chat_template` "
            "explicitly or use a plain-text prompt"
        )
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **kwargs,
    )
    assert isinstance(text, str), type(text)
    return list(tokenizer.encode(text, add_special_tokens=False))


def get_eos_token_ids(
    tokenizer: PreTrainedTokenizerBase | LightTokenizer, generation_config: dict[str, Any] | None
) -> set[int]:
    """EOS ids that end a request: the tokenizer's EOS plus generation_config's (int or list).

    Instruct models often list several (Llama-3: <|end_of_text|> and <|eot_id|>), and the
    tokenizer alone may name only one of them.
    """
    eos_ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    config_eos = (generation_config or {}).get("eos_token_id")
    if isinstance(config_eos, int):
        eos_ids.add(config_eos)
    elif config_eos is not None:
        eos_ids.update(int(i) for i in config_eos)
    return eos_ids
