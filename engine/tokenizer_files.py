"""`load_light_tokenizer`: a folder's tokenizer files, set up as `AutoTokenizer` sets them up;
`load_tokenizer_light_first`: that, else (with a warning saying why) transformers' own.

The steps follow transformers 5's `PreTrainedTokenizerBase._from_pretrained` and
`TokenizersBackend.__init__` (tokenization_utils_base.py / tokenization_utils_tokenizers.py),
in their order, on the same `tokenizers.Tokenizer` calls, so the Rust tokenizer ends up in the
same state (which tokens are added, which are special, the post-processor):
  1. which class transformers would pick (`_tokenizer_kind`); unsupported ones raise;
  2. the backend: tokenizer.json as is, or for Qwen2Tokenizer its rebuilt pipeline;
  3. tokenizer_config.json: chat templates (`chat_template.jinja` and
     `additional_chat_templates/*.jinja` win), special tokens (named, extra, model-specific
     `*_token`), `added_tokens_decoder` (else the legacy special_tokens_map.json and
     tokenizer.json's added tokens); `add_bos_token` / `add_eos_token` are ignored when a
     tokenizer.json exists, as transformers ignores them;
  4. the added and special tokens registered on the backend; a missing post-processor becomes
     the plain template one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.processors import TemplateProcessing

from engine.light_tokenizer import NAMED_SPECIALS, LightTokenizer, UnsupportedTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_QWEN2_MODEL_TYPES = ("qwen2", "qwen3")
# transformers' Qwen2Tokenizer pre-tokenizer (models/qwen2/tokenization_qwen2.py).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2Tokenizer.__init__'s defaults, for keys tokenizer_config.json does not set.
_QWEN2_DEFAULTS = {
    "unk_token": "<|endoftext|>",
    "bos_token": None,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _tokenizer_kind(folder: Path, config: dict[str, Any], model_config: dict[str, Any]) -> str:
    """ "generic" or "qwen2": the class AutoTokenizer would load (models/auto/tokenization_auto)."""
    if not (folder / "tokenizer.json").is_file():
        raise UnsupportedTokenizer(f"no tokenizer.json in {str(folder)!r}")
    if "auto_map" in config:
        raise UnsupportedTokenizer("the tokenizer is remote code (auto_map)")
    declared = config.get("tokenizer_class") or model_config.get("tokenizer_class")
    model_type = model_config.get("model_type")
    if declared is None:
        if model_type in _QWEN2_MODEL_TYPES:
            return "qwen2"
        raise UnsupportedTokenizer(f"no tokenizer_class, and model_type {model_type!r}")
    name = declared.removesuffix("Fast")
    if declared in _GENERIC_CLASSES or name == "PreTrainedTokenizer":
        return "generic"
    if name == "Qwen2Tokenizer":
        return "qwen2"
    # A Llama-3 style folder: the class says LlamaTokenizer (Metaspace), the file is ByteLevel;
    # transformers then loads the generic class.
    if name == "LlamaTokenizer" and '"ByteLevel"' in (folder / "tokenizer.json").read_text("utf-8"):
        return "generic"
    raise UnsupportedTokenizer(f"tokenizer_class {declared!r}")


def _qwen2_backend(tokenizer_json: Path, add_prefix_space: bool) -> Tokenizer:
    """Qwen2Tokenizer's backend: tokenizer.json's vocabulary, merges and post-processor under
    the class's own model options, normalizer, pre-tokenizer and decoder, and no added tokens
    (they come from tokenizer_config.json)."""
    pipeline = Tokenizer(
        BPE(
            vocab={},
            merges=[],
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    pipeline.decoder = decoders.ByteLevel()
    pipeline.normalizer = normalizers.NFC()
    pipeline.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ]
    )
    built = json.loads(pipeline.to_str())
    data = json.loads(tokenizer_json.read_text("utf-8"))
    if data.get("model", {}).get("type") != "BPE":
        raise UnsupportedTokenizer("Qwen2Tokenizer over a tokenizer.json that is not BPE")
    model = dict(built["model"])
    model["vocab"], model["merges"] = data["model"]["vocab"], data["model"].get("merges", [])
    for key in ("normalizer", "pre_tokenizer", "decoder"):
        data[key] = built[key]
    data["model"], data["added_tokens"] = model, []
    return Tokenizer.from_str(json.dumps(data))


def _added_token(value: Any) -> Any:
    """tokenizer_config's `{"__type": "AddedToken", ...}` as an AddedToken; others as given."""
    if isinstance(value, dict) and ("__type" in value or "content" in value):
        fields = {k: v for k, v in value.items() if k not in ("__type", "id")}
        return AddedToken(**fields)
    return value


def _chat_template(folder: Path, config: dict[str, Any]) -> Any:
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text("utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text("utf-8")
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {t["name"]: t["template"] for t in template}
    return template


def _special_tokens(
    folder: Path, config: dict[str, Any], kind: str
) -> tuple[dict[str, Any], list[Any], dict[int, AddedToken]]:
    """(named special tokens incl. model-specific ones, extra special tokens, added tokens)."""
    kwargs = dict(config)
    if kind == "qwen2":
        kwargs = {**_QWEN2_DEFAULTS, **kwargs}
    added: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in kwargs:
        for idx, token in kwargs["added_tokens_decoder"].items():
            added[int(idx)] = _added_token(token)
    else:  # legacy folders
        for key, value in _read_json(folder / "special_tokens_map.json").items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = AddedToken(
                    **{k: v for k, v in value.items() if k != "special"}, special=True
                )
            kwargs[key] = value
        for token in _read_json(folder / "tokenizer.json").get("added_tokens", []):
            added[token["id"]] = _added_token(token)
    by_content = {str(t): t for t in added.values()}
    if kwargs.get("additional_special_tokens") and not kwargs.get("extra_special_tokens"):
        kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
    named: dict[str, Any] = {}
    for key in NAMED_SPECIALS:
        value = _added_token(kwargs.get(key))
        named[key] = by_content.get(str(value), value) if value is not None else None
    extra = kwargs.get("extra_special_tokens") or []
    if isinstance(extra, dict):  # named model-specific tokens
        named.update({k: _added_token(v) for k, v in extra.items()})
        extra = []
    for key, value in kwargs.items():
        value = _added_token(value)
        if (
            key.endswith("_token")
            and key not in NAMED_SPECIALS
            and isinstance(value, (str, AddedToken))
        ):
            named[key] = value
    return named, [_added_token(t) for t in extra], added


def _register_tokens(
    backend: Tokenizer, named: dict[str, Any], extra: list[Any], added: dict[int, AddedToken]
) -> None:
    """TokenizersBackend.__init__: the configured added tokens, then the special tokens the
    backend does not know yet, all through one `add_tokens` call."""
    to_add = [token for _, token in sorted(added.items())]
    encoder = {t.content for t in backend.get_added_tokens_decoder().values()}
    encoder.update(str(t) for t in to_add)
    for token in [*named.values(), *extra]:
        if token is not None and str(token) not in encoder:
            to_add.append(token)
            encoder.add(str(token))
    named_contents = {str(t) for t in named.values() if t}
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named_contents:
            token.special = True
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)


def load_light_tokenizer(path: str | Path) -> LightTokenizer:
    """The tokenizer of a local model folder; `UnsupportedTokenizer` if it needs transformers."""
    folder = Path(path)
    config = _read_json(folder / "tokenizer_config.json")
    kind = _tokenizer_kind(folder, config, _read_json(folder / "config.json"))
    if kind == "qwen2":
        backend = _qwen2_backend(folder / "tokenizer.json", bool(config.get("add_prefix_space")))
    else:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.no_truncation()  # encode() never truncates or pads in transformers either
    backend.no_padding()
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    named, extra, added = _special_tokens(folder, config, kind)
    _register_tokens(backend, named, extra, added)
    special_tokens = {k: str(v) for k, v in named.items() if v is not None}
    extra_special_tokens = [str(t) for t in extra]
    if kind == "qwen2":  # Qwen2Tokenizer.__init__ ends by adding every special token as such
        all_special = dict.fromkeys([*special_tokens.values(), *extra_special_tokens])
        backend.add_tokens([AddedToken(t, special=True) for t in all_special])
    if backend.post_processor is None:
        backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    return LightTokenizer(
        backend,
        name_or_path=str(path),
        special_tokens=special_tokens,
        extra_special_tokens=extra_special_tokens,
        chat_template=_chat_template(folder, config),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
    )


def load_tokenizer_light_first(
    path: Path, trust_remote_code: bool = False
) -> LightTokenizer | PreTrainedTokenizerBase:
    """The light tokenizer, else (with a warning saying why) transformers' own: the gateway's
    and `tandem bench serve`'s, which need no transformers import for the folders it covers."""
    if not trust_remote_code:
        try:
            return load_light_tokenizer(path)
        except UnsupportedTokenizer as e:
            reason = str(e)
    else:
        reason = "--trust-remote-code"
    logger.warning(
        "transformers (and torch) are loaded for this tokenizer: %s; this process starts "
        "slower and idles larger",
        reason,
    )
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(path, trust_remote_code=trust_remote_code)
