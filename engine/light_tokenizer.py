"""A model folder's tokenizer on the `tokenizers` library alone: no transformers, no torch.

Why: transformers 5 imports torch from its config classes whenever torch is installed, and a
gateway replica must start in seconds and idle small. `LightTokenizer` offers the part of
`PreTrainedTokenizerBase` that serving uses (encode, decode, convert_ids_to_tokens,
convert_tokens_to_string, special tokens and their ids, get_vocab, apply_chat_template) with
transformers' results: `load_light_tokenizer` (engine/tokenizer_files.py) repeats what
`AutoTokenizer.from_pretrained` does to the Rust tokenizer of `tokenizer.json` (special and
added tokens from tokenizer_config.json, split_special_tokens, the default post-processor,
clean-up on decode), and chat templates render through `engine.chat_template`.
tests/engine/test_light_tokenizer.py holds it to transformers' output, ids and text, on the test
models.

What it covers: a `tokenizer.json` whose class is the generic fast one (PreTrainedTokenizerFast,
TokenizersBackend, or LlamaTokenizer over a ByteLevel file, which transformers loads the same
way) or Qwen2Tokenizer (whose pipeline transformers rebuilds from the vocabulary: done here the
same way). Anything else (remote code, sentencepiece-only folders, other model-specific classes)
raises `UnsupportedTokenizer`, and the caller loads transformers instead.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer

from engine import chat_template as templates

NAMED_SPECIALS = (  # transformers' SPECIAL_TOKENS_ATTRIBUTES
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# apply_chat_template options of transformers that shape tensors, not text: refused if set.
_ENCODE_OPTIONS = (
    "sanitize_control_tokens",
    "return_assistant_tokens_mask",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "tokenizer_kwargs",
)


class UnsupportedTokenizer(ValueError):
    """This folder's tokenizer needs transformers (the message says why)."""


class LightTokenizer:
    """The serving subset of a transformers fast tokenizer, over a `tokenizers.Tokenizer`."""

    is_fast = True

    def __init__(
        self,
        backend: Tokenizer,
        *,
        name_or_path: str,
        special_tokens: dict[str, str],
        extra_special_tokens: list[str],
        chat_template: templates.ChatTemplate | None,
        clean_up_tokenization_spaces: bool = False,
    ):
        self.backend_tokenizer = backend
        self.name_or_path = name_or_path
        self.special_tokens_map = special_tokens  # bos_token, eos_token, ... (set ones only)
        self.extra_special_tokens = extra_special_tokens
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.all_special_tokens = list(
            dict.fromkeys([*special_tokens.values(), *extra_special_tokens])
        )
        self.all_special_ids = self.convert_tokens_to_ids(self.all_special_tokens)
        self._special_prefix, self._special_suffix = self._special_affixes()
        self._vocab: dict[str, int] | None = None  # the vocabulary is fixed once loaded

    def __getattr__(self, name: str) -> Any:
        # bos_token / eos_token_id / ... like transformers: None when the token is not set.
        base = name.removesuffix("_id")
        if base in NAMED_SPECIALS or base in self.__dict__.get("special_tokens_map", {}):
            token = self.special_tokens_map.get(base)
            if name == base or token is None:
                return token
            return self.convert_tokens_to_ids(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name}")

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        """A fresh copy, as transformers returns: building it from the Rust side costs ~70 ms
        for 49k tokens (parsers ask per request), copying the cached one ~1 ms."""
        if self._vocab is None:
            self._vocab = self.backend_tokenizer.get_vocab(with_added_tokens=True)
        return dict(self._vocab)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}

    # --- tokens and ids
    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            token_id = self.backend_tokenizer.token_to_id(tokens)
            if token_id is None and tokens != self.special_tokens_map.get("unk_token"):
                return self.unk_token_id
            return token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(
        self, ids: int | list[int], skip_special_tokens: bool = False
    ) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend_tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    # --- text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`Tokenizer.encode`'s ids by `encode_batch_fast`: the same ids without the character
        offsets nothing here reads (0.78-0.81x the time on SmolLM2's tokenizer, 120 B to
        30 KB of text), and the GIL released."""
        (encoding,) = self.backend_tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )
        return encoding.ids

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens

    def decode(
        self,
        token_ids: int | list[int] | list[list[int]],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str | list[str]:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [
                self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces)
                for ids in token_ids
            ]
        text = self.backend_tokenizer.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens
        )
        if self._cleans_up(clean_up_tokenization_spaces):
            text = _clean_up_tokenization(text)
        return text

    def _cleans_up(self, clean_up_tokenization_spaces: bool | None) -> bool:
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        # transformers skips the clean-up for BPE: it strips real spaces before punctuation.
        is_bpe = type(self.backend_tokenizer.model).__name__ == "BPE"
        return bool(clean_up_tokenization_spaces) and not is_bpe

    def batch_decode(
        self,
        sequences: list[list[int]],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> list[str]:
        """`decode` of each sequence; without a clean-up, in one Rust call on all cores."""
        if self._cleans_up(clean_up_tokenization_spaces):
            return [self.decode(ids, skip_special_tokens, True) for ids in sequences]
        return self.backend_tokenizer.decode_batch(
            [list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens
        )

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return self.backend_tokenizer.num_special_tokens_to_add(pair)

    def build_inputs_with_special_tokens(self, token_ids: list[int]) -> list[int]:
        """`token_ids` wrapped in the specials `encode(..., add_special_tokens=True)` adds."""
        return [*self._special_prefix, *token_ids, *self._special_suffix]

    def _special_affixes(self) -> tuple[list[int], list[int]]:
        probe = "a"
        plain = self.encode(probe, add_special_tokens=False)
        full = self.encode(probe, add_special_tokens=True)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
        return [], []

    # --- chat
    def get_chat_template(self, chat_template_arg: str | None = None, tools: list | None = None):
        return templates.select_template(self.chat_template, chat_template_arg, tools)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> str | list[str] | list[int] | list[list[int]] | dict[str, Any]:
        """transformers' `apply_chat_template` (text or ids; no padding, tensors or masks)."""
        for option in _ENCODE_OPTIONS:
            if kwargs.pop(option, None):
                raise NotImplementedError(f"LightTokenizer.apply_chat_template: no {option}")
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        is_batched = isinstance(conversation[0], (list, tuple)) or hasattr(
            conversation[0], "messages"
        )
        conversations = conversation if is_batched else [conversation]
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final message, "
                "and add_generation_prompt when you want to add a header that will prompt it to "
                "start a new assistant message instead."
            )
        template_kwargs = {**self.special_tokens_map, **kwargs}
        texts = [
            templates.render(
                template,
                templates.normalize_messages(chat),
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **template_kwargs,
            )
            for chat in conversations
        ]
        if not tokenize:
            return texts if is_batched else texts[0]
        ids = [self.encode(text, add_special_tokens=False) for text in texts]
        result = ids if is_batched else ids[0]
        if not return_dict:
            return result
        mask = [[1] * len(x) for x in ids]
        return {"input_ids": result, "attention_mask": mask if is_batched else mask[0]}


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):  # fmt: skip
        text = text.replace(before, after)
    return text
