"""--reasoning-parser: `<think>` reasoning split into `reasoning_content`, streamed and not.

The parsers are checked on texts (streamed in pieces of every size must give what the whole
text gives), then end to end through the SDK: a scripted decode streams the Qwen tokenizer's
real `<think>` / `</think>` tokens one by one; with structured outputs the engine constrains only
what follows the reasoning.
"""

from __future__ import annotations

import openai
import pytest

from engine.sampling_params import SamplingParams, StructuredOutputsParams
from gateway.reasoning import REASONING_PARSERS, ReasoningParserError
from tests.fixtures.tiny_models import QWEN_IM_END_ID, QWEN_THINK_END_ID, QWEN_THINK_ID
from tests.gateway.qwen_gateway import (  # noqa: F401 (fixtures)
    QWEN_SERVED,
    qwen_fixture,
    qwen_gateway_fixture,
    reset_qwen_decode_fixture,
)

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "<think>\nThe user asks about France.\n</think>\n\nParis is the capital."


class _Tokenizer:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


_THINK_VOCAB = _Tokenizer({"<think>": 7, "</think>": 8})


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("qwen3", "<think>abc</think>xyz", ("abc", "xyz")),
        ("qwen3", "<think>abc</think>", ("abc", None)),
        ("qwen3", "<think>abc", ("abc", None)),  # cut by max_tokens while thinking
        ("qwen3", "xyz", (None, "xyz")),  # thinking disabled
        ("qwen3", "x<think>y</think>z", (None, "x<think>y</think>z")),
        ("qwen3", "abc</think>xyz", (None, "abc</think>xyz")),
        ("qwen3", "", (None, "")),
        ("deepseek_r1", "abc</think>xyz", ("abc", "xyz")),  # <think> was in the prompt
        ("deepseek_r1", "<think>abc</think>xyz", ("abc", "xyz")),
        ("deepseek_r1", "abc", ("abc", None)),
        ("deepseek_r1", "</think>", ("", None)),
        ("deepseek_r1", "<thi", ("<thi", None)),
    ],
)
def test_extract_and_stream_agree(name, text, expected):
    parser = REASONING_PARSERS[name](_THINK_VOCAB)
    assert parser.extract_reasoning(text) == expected
    reasoning, content = expected
    for size in (1, 2, 3, 5, 8, len(text) or 1):
        stream = parser.streamer()
        parts = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
        parts.append(stream.finish())
        assert "".join(r for r, _ in parts) == (reasoning or ""), size
        assert "".join(c for _, c in parts) == (content or ""), size


def test_a_partial_tag_is_held_back_until_it_resolves():
    stream = REASONING_PARSERS["qwen3"](_THINK_VOCAB).streamer()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>abc</th") == ("abc", "")
    assert stream.feed("ink>Paris") == ("", "Paris")


def test_parser_needs_the_think_tokens():
    with pytest.raises(ReasoningParserError, match="could not locate think start/end tokens"):
        REASONING_PARSERS["qwen3"](_Tokenizer({"<think>": 1}))


# ---- end to end, with the Qwen tokenizer --------------------------------------------------


def _script(qwen, text: str) -> list[int]:
    ids = qwen.encode(text) + [QWEN_IM_END_ID]
    assert QWEN_THINK_ID in ids or "<think>" not in text
    return ids


def _streamed(client, **kwargs) -> tuple[str, str, str | None]:
    reasoning = content = ""
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


def test_reasoning_split_streamed_and_not(qwen, qwen_gateway):
    qwen.decode.script = _script(qwen, ANSWER)
    assert qwen.decode.script.count(QWEN_THINK_END_ID) == 1  # the real single tokens
    kwargs = dict(model=QWEN_SERVED, messages=MESSAGES, max_tokens=50)
    with qwen_gateway(reasoning_parser="qwen3") as client:
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.reasoning_content == "\nThe user asks about France.\n"
        assert message.content == "\n\nParis is the capital."
        assert _streamed(client, **kwargs) == (
            message.reasoning_content,
            message.content,
            "stop",
        )
    with qwen_gateway() as client:  # no parser: the text as generated
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.content == ANSWER
        assert getattr(message, "reasoning_content", None) is None


def test_include_reasoning_false_drops_it(qwen, qwen_gateway):
    qwen.decode.script = _script(qwen, ANSWER)
    kwargs = dict(
        model=QWEN_SERVED,
        messages=MESSAGES,
        max_tokens=50,
        extra_body={"include_reasoning": False},
    )
    with qwen_gateway(reasoning_parser="qwen3") as client:
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.reasoning_content is None
        assert message.content == "\n\nParis is the capital."
        assert _streamed(client, **kwargs) == ("", message.content, "stop")


def test_deepseek_r1_reads_reasoning_without_the_opening_tag(qwen, qwen_gateway):
    qwen.decode.script = _script(qwen, "Thinking about it.</think>It is Paris.")
    kwargs = dict(model=QWEN_SERVED, messages=MESSAGES, max_tokens=50)
    with qwen_gateway(reasoning_parser="deepseek_r1") as client:
        message = client.chat.completions.create(**kwargs).choices[0].message
        expected = ("Thinking about it.", "It is Paris.")
        assert (message.reasoning_content, message.content) == expected
        assert _streamed(client, **kwargs) == (*expected, "stop")


def test_reasoning_effort_reaches_the_template(qwen, qwen_gateway):
    qwen.decode.script = [QWEN_IM_END_ID]
    template = "{{ reasoning_effort }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with qwen_gateway(trust_request_chat_template=True) as client:
        client.chat.completions.create(
            model=QWEN_SERVED,
            messages=[{"role": "user", "content": "Hi"}],
            reasoning_effort="low",
            extra_body={"chat_template": template},
        )
    (request,) = qwen.decode.record.requests
    assert qwen.model_info.tokenizer.decode(request.prompt_token_ids) == "low|Hi"


def test_structured_outputs_carry_the_think_ids(qwen, qwen_gateway):
    qwen.decode.script = _script(qwen, "<think>x</think>yes")
    with qwen_gateway(reasoning_parser="qwen3") as client:
        message = (
            client.chat.completions.create(
                model=QWEN_SERVED,
                messages=MESSAGES,
                extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
            )
            .choices[0]
            .message
        )
    assert (message.reasoning_content, message.content) == ("x", "yes")
    so = qwen.decode.record.requests[0].params.structured_outputs
    assert list(so.choice.choices) == ["yes", "no"]
    assert (so.reasoning_start_token_id, so.reasoning_end_token_id) == (
        QWEN_THINK_ID,
        QWEN_THINK_END_ID,
    )


def test_the_constraint_starts_after_the_reasoning(qwen, qwen_gateway):
    """The engine leaves the reasoning free: a bias makes the random model close it at once,
    then the grammar holds. Without the reasoning ids the grammar forbids `</think>` from the
    first token."""
    kwargs = dict(
        model=QWEN_SERVED,
        messages=MESSAGES,
        temperature=0,
        max_tokens=20,
        logit_bias={str(QWEN_THINK_END_ID): 100},
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    with qwen_gateway(reasoning_parser="deepseek_r1") as client:
        choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.reasoning_content == ""
    assert choice.message.content in ("yes", "no") and choice.finish_reason == "stop"
    # The same on the offline engine with the ids set by hand.
    so = StructuredOutputsParams(
        choice=["yes", "no"],
        reasoning_start_token_id=QWEN_THINK_ID,
        reasoning_end_token_id=QWEN_THINK_END_ID,
    )
    params = SamplingParams(
        temperature=0, max_tokens=20, logit_bias={QWEN_THINK_END_ID: 100}, structured_outputs=so
    )
    offline = qwen.llm.chat(MESSAGES, params)[0].outputs[0].text
    assert offline == "</think>" + choice.message.content
    with qwen_gateway() as client:  # constrained from the first token
        assert client.chat.completions.create(**kwargs).choices[0].message.content in ("yes", "no")


def test_enable_thinking_false_constrains_from_the_start(qwen, qwen_gateway):
    """Qwen3's template closes an empty reasoning block in the prompt: the engine sees the
    reasoning ended there, and the whole output follows the grammar (content, no reasoning)."""
    with qwen_gateway(reasoning_parser="qwen3") as client:
        message = (
            client.chat.completions.create(
                model=QWEN_SERVED,
                messages=MESSAGES,
                temperature=0,
                max_tokens=20,
                extra_body={
                    "structured_outputs": {"regex": "(Paris|Rome|Berlin)"},
                    "chat_template_kwargs": {"enable_thinking": False},
                },
            )
            .choices[0]
            .message
        )
    assert message.reasoning_content is None
    assert message.content in ("Paris", "Rome", "Berlin")


def test_unknown_reasoning_parser_is_refused_at_startup():
    from gateway.__main__ import parse_args, settings_from_args

    args = parse_args(["--model", "m", "--reasoning-parser", "nope"])
    with pytest.raises(ValueError, match="invalid reasoning parser: nope"):
        settings_from_args(args)


def test_sdk_sees_a_400_for_a_bad_include_reasoning(qwen, qwen_gateway):
    with qwen_gateway(reasoning_parser="qwen3") as client, pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=QWEN_SERVED, messages=MESSAGES, extra_body={"include_reasoning": "no"}
        )
