"""Chat templates rendered as transformers (5.x) renders them, without importing transformers.

The gateway renders every chat prompt and must not load transformers (and with it torch), so
this module repeats `transformers.utils.chat_template_utils` where it decides the text: the
sandboxed Jinja environment (trim_blocks, lstrip_blocks, loopcontrols, the `{% generation %}`
tag), its globals (`raise_exception`, `strftime_now`, `dict`, a `namespace` refusing `_` names),
the `tojson` filter (ensure_ascii=False, indent / separators / sort_keys), how messages are
cleaned before the template sees them (None values dropped, plain JSON types only, reasoning
aliased under `reasoning_content` and `thinking`), the choice among named templates, and
`continue_final_message`. tests/engine/test_light_tokenizer.py checks the rendered text and ids
against transformers itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# Types `_to_dicts` and `_plain` return as they are (exact types: subclasses take the long way).
_SCALARS = frozenset((str, int, float, bool, type(None)))

_NOT_A_MESSAGE = "Chat messages should be dicts, dataclasses or pydantic models, but got {!r}."

ChatTemplate = str | dict[str, str]


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks the span
    for assistant masks; serving needs only the text)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in templates, without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (no way to reach CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                f"got {name!r}. Please rename the attribute."
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own filter escapes HTML characters, which no chat template wants.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=128)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    template = env.from_string(source)
    # Jinja keeps a template's globals as a ChainMap over the environment's, copied into a dict
    # key by key (in Python) at every render; this environment is never changed again, so one
    # plain dict of the same names is the same lookup, ~3 us cheaper per render.
    template.globals = dict(template.globals)
    return template


def select_template(own: ChatTemplate | None, chat_template: str | None, tools: list | None) -> str:
    """The template to render: a name among the model's templates, the given text, the model's
    `tool_use` one when tools are passed, else its `default` (transformers' get_chat_template)."""
    if isinstance(own, dict):
        if chat_template is not None and chat_template in own:
            return own[chat_template]
        if chat_template is None:
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(
                "This model has multiple chat templates with no default specified! Please either "
                "pass a chat template or the name of the template you wish to use to the "
                f"`chat_template` argument. Available template names are {sorted(own)}."
            )
        return chat_template
    if chat_template is not None:
        return chat_template
    if own is None:
        raise ValueError(
            "Cannot use chat template functions because tokenizer.chat_template is not set and "
            "no template argument was passed!"
        )
    return own


def _to_dicts(value: Any) -> Any:
    """Message objects (pydantic models, dataclasses) as dicts, media left as is."""
    if type(value) in _SCALARS:
        return value
    if type(value) is dict:  # the usual cases first: no ABC check, no call for plain values
        return {k: v if type(v) in _SCALARS else _to_dicts(v) for k, v in value.items()}
    if type(value) is list:
        return [v if type(v) in _SCALARS else _to_dicts(v) for v in value]
    if isinstance(value, Mapping):
        return {key: _to_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_to_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _to_dicts(value.model_dump())
    return value


def normalize_messages(conversation: Any) -> list[dict]:
    """Dicts, with the keys whose value is None dropped (templates print "None" otherwise)."""
    messages = _to_dicts(getattr(conversation, "messages", conversation))
    result = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(_NOT_A_MESSAGE.format(message))
        result.append({k: v for k, v in message.items() if v is not None})
    return result


def _plain(value: Any) -> Any:
    """Only plain JSON types reach the sandbox; anything else becomes "<TypeName>"."""
    if type(value) in _SCALARS:
        return value
    if type(value) is dict:  # the usual case: no ABC check, no call for string keys and values
        return {
            key if type(key) is str else _plain(key): item
            if type(item) in _SCALARS
            else _plain(item)
            for key, item in value.items()
        }
    if type(value) is list:
        return [item if type(item) in _SCALARS else _plain(item) for item in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return _plain(value.item())  # numpy scalars (np.bool_(False) must stay falsy)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    aliased = []
    for message in chat:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def render(
    template: str,
    messages: list[dict],
    *,
    tools: list | None = None,
    documents: list | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **kwargs: Any,
) -> str:
    """One normalized conversation rendered with `template` (a template's text, not a name)."""
    compiled = compile_template(template)
    if tools is not None and any(not isinstance(t, dict) for t in tools):
        raise ValueError(
            "Tools should either be a JSON schema, or a callable function with type hints "
            "and a docstring suitable for auto-conversion to a schema."
        )
    if documents is not None and any(not isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    tools, documents, kwargs = _plain(tools), _plain(documents), _plain(kwargs)
    chat = _plain(messages)
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(_NOT_A_MESSAGE.format(message))
    chat = _alias_reasoning(chat)
    final_message = None
    if continue_final_message:
        chat, final_message = _tag_final_message(chat, template, continue_final_message)
    text = compiled.render(
        messages=chat,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    if continue_final_message:
        text = _cut_at_tag(text, final_message)
    return text


def _tag_final_message(chat: list[dict], template: str, field: bool | str) -> tuple[list, str]:
    """Append the continuation tag to the last message's text (where the output is cut)."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    field = field if isinstance(field, str) else "content"
    final_message = chat[-1].get(field)
    if final_message is None:
        raise ValueError(
            f'continue_final_message is set but the final message has no "{field}" to continue!'
        )
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final_message]
    if not any(f in template for f in fields):
        raise ValueError(
            f'continue_final_message is set to "{field}" but this is not an accepted field in '
            "the chat_template"
        )
    if isinstance(final_message, (list, tuple)):
        for block in reversed(final_message):
            if "text" in block:
                final_message = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError(
                "continue_final_message is set but we could not find any text to continue in the "
                "final message!"
            )
    else:
        for f in fields:
            chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return chat, final_message


def _cut_at_tag(text: str, final_message: str) -> str:
    if final_message.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message. Please verify the chat template and final message "
            "in your chat to ensure they are compatible."
            f"Final message to continue: {final_message.strip()}\nRendered chat:\n{text}"
        )
    tag_loc = text.rindex(_CONTINUE_TAG.strip())
    if text[tag_loc : tag_loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:tag_loc]
    return text[:tag_loc].rstrip()  # the template trimmed the message's trailing space
