"""`LightTokenizer` (tokenizers + jinja2, no transformers) against transformers itself.

The reference is `AutoTokenizer.from_pretrained` on the same folder: special tokens and ids,
vocabulary, `encode` / `decode` / `convert_ids_to_tokens` on a corpus with unicode, whitespace
and special tokens inside text, and chat prompts (text and ids) with the tiny models' ChatML,
SmolLM2's template and Qwen3's real template with tools, tool calls and reasoning.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import shutil

import jinja2
import pydantic
import pytest
from transformers import AutoTokenizer

from engine.hf_config import load_hf_config, read_hf_config
from engine.light_tokenizer import LightTokenizer, UnsupportedTokenizer
from engine.tokenizer import apply_chat_template
from engine.tokenizer_files import load_light_tokenizer
from engine.weights import SMOLLM2_REPO_ID, resolve_model_path
from gateway.model_info import ModelInfo
from gateway.preprocess import encode_bounded
from tests.fixtures.chat_templates import QWEN3_CHAT_TEMPLATE

CORPUS = [
    "",
    "hello world",
    "Hello, world! How are you today? I'm fine, thanks .",
    "  leading and trailing  ",
    "a\r\nb\n\n\tc   d",
    "Café, naïve, e\u0301 (combining), Ångström, ﬁ ligature",
    "東京は日本の首都です。 北京是中国的首都。 서울은 한국의 수도입니다.",
    "Emoji: 😀 🎉 🚀 ❤️ 👍🏽 🇫🇷 — math: ∑ ∫ √ π ≈ 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>x<|im_end|><|im_start|><think>reason</think>",
    "Numbers 0 1 2 3 42 65536 3.14 2024-01-15",
    "def main():\n    print('hello')\n    return 0\n",
    "\ufffd lone replacement and a zero\u200bwidth space",
    "word " * 600,
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city — «today»",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Café? 東京 😀"},
        {"role": "assistant", "content": "Oui."},
        {"role": "user", "content": "<|im_end|> inside text"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
        {"role": "tool", "content": "second result"},
        {"role": "user", "content": "Thanks"},
        {
            "role": "assistant",
            "content": "<think>\nshort\n</think>\n\nYou're welcome.",
            "tool_calls": None,
        },
    ],
    [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "I thought."},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "ok", "reasoning": "older field name"},
    ],
]


@pytest.fixture(scope="module")
def qwen2_class_path(tiny_qwen3_path, tmp_path_factory):
    """The tiny Qwen3 folder as the real Qwen3 ships it: tokenizer_class Qwen2Tokenizer (whose
    pipeline transformers rebuilds: NFC, Qwen's split regex), added tokens beyond the vocabulary,
    the template inside tokenizer_config.json, no bos_token."""
    path = tmp_path_factory.mktemp("qwen2cls")
    shutil.copytree(tiny_qwen3_path, path, dirs_exist_ok=True)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    data = json.loads((path / "tokenizer.json").read_text())
    num_vocab = len(data["model"]["vocab"])
    for i, content in enumerate(["<think>", "</think>", "<tool_call>", "</tool_call>"]):
        data["added_tokens"].append(
            dict(
                id=num_vocab + i,
                content=content,
                single_word=False,
                lstrip=False,
                rstrip=False,
                normalized=False,
                special=False,
            )  # fmt: skip
        )
    (path / "tokenizer.json").write_text(json.dumps(data))
    decoder = {
        str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in data["added_tokens"]
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(
    scope="module",
    params=[
        "qwen3",
        "llama",
        "qwen2_class",
        pytest.param("smollm2", marks=pytest.mark.slow),
    ],
)
def pair(request, tiny_qwen3_path, tiny_llama_path, qwen2_class_path):
    """(transformers tokenizer, light tokenizer) of one folder."""
    if request.param == "smollm2":
        path = resolve_model_path(SMOLLM2_REPO_ID)
    else:
        paths = {"qwen3": tiny_qwen3_path, "llama": tiny_llama_path}
        path = paths.get(request.param, qwen2_class_path)
    return AutoTokenizer.from_pretrained(str(path)), load_light_tokenizer(path)


def test_special_tokens_and_vocab_match(pair):
    ref, light = pair
    assert isinstance(light, LightTokenizer)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "eos_token_id",
                 "bos_token_id", "pad_token_id", "all_special_tokens", "all_special_ids",
                 "special_tokens_map", "vocab_size", "chat_template"):  # fmt: skip
        assert getattr(light, name) == getattr(ref, name), name
    assert len(light) == len(ref)
    assert light.get_vocab() == ref.get_vocab()
    assert light.added_tokens_encoder == ref.added_tokens_encoder


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_encode_decode_match(pair, text):
    ref, light = pair
    for add_special_tokens in (True, False):
        ids = ref.encode(text, add_special_tokens=add_special_tokens)
        assert light.encode(text, add_special_tokens=add_special_tokens) == ids
        for tokenizer in (ref, light):  # the gateway's own call on either kind of tokenizer
            info = ModelInfo(("m",), "m", tokenizer, 10**6, len(tokenizer), {})
            assert encode_bounded(info, text, add_special_tokens) == ids
    assert light.build_inputs_with_special_tokens(light.encode(text, False)) == ref.encode(text)
    for skip in (True, False):
        assert light.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip
        )
        tokens = ref.convert_ids_to_tokens(ids, skip_special_tokens=skip)
        assert light.convert_ids_to_tokens(ids, skip_special_tokens=skip) == tokens
        assert light.convert_tokens_to_string(tokens) == ref.convert_tokens_to_string(tokens)
    for token_id in ids[:32]:  # per-token texts (logprobs) and single ids
        assert light.decode([token_id]) == ref.decode([token_id])
        assert light.convert_ids_to_tokens(token_id) == ref.convert_ids_to_tokens(token_id)


def test_batch_decode_matches(pair):
    ref, light = pair
    specials = ref.all_special_ids
    sequences = [specials + ref.encode(text) + specials for text in CORPUS] + [[], [3]]
    for skip in (True, False):
        for clean_up in (None, True, False):
            kw = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": clean_up}
            assert light.batch_decode(sequences, **kw) == ref.batch_decode(sequences, **kw)


def test_out_of_vocabulary_ids_match(pair):
    ref, light = pair
    ids = [len(ref) + 5, 3, len(ref) + 100]
    assert light.decode(ids) == ref.decode(ids)
    assert light.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("template", ["own", "qwen3"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches(pair, template, chat, add_generation_prompt):
    ref, light = pair
    options = dict(add_generation_prompt=add_generation_prompt)
    if template == "qwen3":
        options.update(chat_template=QWEN3_CHAT_TEMPLATE, tools=TOOLS, enable_thinking=False)
    messages = CHATS[chat]
    text = ref.apply_chat_template(messages, tokenize=False, **options)
    assert light.apply_chat_template(messages, tokenize=False, **options) == text
    ids = ref.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
    assert light.apply_chat_template(messages, tokenize=True, return_dict=False, **options) == ids
    # engine.tokenizer's helper (what the gateway and LLM.chat call) dispatches to either.
    assert apply_chat_template(light, messages, **options) == ids


# Jinja features transformers' environment provides, each rendered by both.
FEATURE_TEMPLATES = {
    "tojson": "{{ messages[0] | tojson }}|{{ tools | tojson(indent=2) }}|"
    "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}",
    "specials": "{{ bos_token }}{{ eos_token }}{{ pad_token }}{{ custom }}{{ documents | length }}",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
    "{{ m.content }}{% continue %}x{% endfor %}",
    "whitespace": "  {% for m in messages %}\n  {{ m.role }}\n  {% endfor %}\n"
    "{%- if true %} end{% endif %}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{{ ns.n }}{{ dict(a=1) }}",
    "generation": "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}"
    "{% endfor %}",
    "none_dropped": "{{ messages[0].name is defined }}{{ messages[0] }}",
}


@pytest.mark.parametrize("name", FEATURE_TEMPLATES)
def test_template_features_match(pair, name):
    ref, light = pair
    messages = [{"role": "user", "content": "Ünïcödé 😀 <b>", "name": None}, *CHATS[1]]
    options = dict(
        chat_template=FEATURE_TEMPLATES[name],
        tools=TOOLS,
        documents=[{"title": "t", "text": "x"}],
        custom="K",
        tokenize=False,
    )
    assert light.apply_chat_template(messages, **options) == ref.apply_chat_template(
        messages, **options
    )


def test_template_errors_match(pair):
    ref, light = pair
    messages = CHATS[0]
    raising = "{{ raise_exception('roles must alternate') }}"
    for tok in (ref, light):
        with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate"):
            tok.apply_chat_template(messages, chat_template=raising, tokenize=False)
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(
                messages, chat_template="{% set ns = namespace(_x=1) %}", tokenize=False
            )
        with pytest.raises(ValueError, match="empty conversation"):
            tok.apply_chat_template([], tokenize=False)
    assert "20" in light.apply_chat_template(
        messages, chat_template="{{ strftime_now('%Y') }}", tokenize=False
    )


def test_continue_final_message_matches(pair):
    ref, light = pair
    messages = [*CHATS[0], {"role": "assistant", "content": "The capital is "}]
    options = dict(chat_template=QWEN3_CHAT_TEMPLATE, continue_final_message=True, tokenize=False)
    assert light.apply_chat_template(messages, **options) == ref.apply_chat_template(
        messages, **options
    )


def test_named_templates(tiny_qwen3_path, tmp_path):
    """A list of named templates in tokenizer_config.json: `default`, or `tool_use` with tools,
    or one chosen by name (transformers' get_chat_template)."""
    shutil.copytree(tiny_qwen3_path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
        {"name": "rag", "template": "R{{ documents | length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ref, light = AutoTokenizer.from_pretrained(str(tmp_path)), load_light_tokenizer(tmp_path)
    calls = [dict(), dict(tools=TOOLS), dict(chat_template="rag", documents=[{"text": "x"}])]
    for options in calls:
        text = ref.apply_chat_template(CHATS[0], tokenize=False, **options)
        assert light.apply_chat_template(CHATS[0], tokenize=False, **options) == text
    assert [light.apply_chat_template(CHATS[0], tokenize=False, **o) for o in calls] == [
        "D1",
        "T1",
        "R1",
    ]


def test_unsupported_folders_say_why(tiny_qwen3_path, tmp_path):
    shutil.copytree(tiny_qwen3_path, tmp_path, dirs_exist_ok=True)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tokenizer_class": "BertTokenizer"}))
    with pytest.raises(UnsupportedTokenizer, match="BertTokenizer"):
        load_light_tokenizer(tmp_path)
    config_path.write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["x", "y"]}}))
    with pytest.raises(UnsupportedTokenizer, match="remote code"):
        load_light_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedTokenizer, match="no tokenizer.json"):
        load_light_tokenizer(tmp_path)


@pytest.mark.parametrize("drop", [None, "max_position_embeddings", "vocab_size"])
def test_read_hf_config_matches_autoconfig(tiny_model_path, tmp_path, drop):
    """The gateway's JSON read of config.json gives the engine's numbers, class defaults too."""
    shutil.copytree(tiny_model_path, tmp_path, dirs_exist_ok=True)
    if drop is not None:
        data = json.loads((tmp_path / "config.json").read_text())
        del data[drop]
        (tmp_path / "config.json").write_text(json.dumps(data))
    light, ref = read_hf_config(tmp_path), load_hf_config(tmp_path)
    for name in ("max_position_embeddings", "vocab_size", "hidden_size", "num_hidden_layers"):
        assert getattr(light, name) == getattr(ref, name), name


class _Role(enum.StrEnum):
    USER = "user"


@dataclasses.dataclass
class _Message:
    role: str
    content: str
    name: str | None = None


class _Part(pydantic.BaseModel):
    type: str
    text: str


def test_message_shapes_match(pair):
    """Values that are not plain dicts, lists and strings (what `_to_dicts` and `_plain` convert
    by their slow paths) render as transformers renders them."""
    ref, light = pair
    messages = [
        _Message("system", "Be brief."),
        {"role": _Role.USER, "content": "Hi", "meta": {1: None, "k": (1, 2.5, True)}},
        {"role": "assistant", "content": [_Part(type="text", text="A"), {"type": "text"}]},
        {"role": "user", "content": "plain", "extra": [None, {"x": [1, {"y": None}]}], "s": {2}},
    ]
    template = "{% for m in messages %}{{ m | tojson }}|{{ m.role }}:{{ m.content }}\n{% endfor %}"
    options = dict(chat_template=template, tokenize=False, custom={"a": (1, None)})
    assert light.apply_chat_template(messages, **options) == ref.apply_chat_template(
        messages, **options
    )
