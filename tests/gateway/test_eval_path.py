"""The evaluation path through the API, as vLLM serves it: completions `echo` (with `logprobs`
and `max_tokens=0`), `prompt_logprobs` on both routes, and `logit_bias`. Prompt logprobs are
checked against transformers (a reference we did not write), through the official SDK.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from engine import SamplingParams
from tests.engine.hf_reference import hf_logprobs
from tests.gateway.conftest import SERVED_NAME

PROMPT = "The quick brown fox jumps over the lazy dog"
IDS = [5, 60, 400, 17, 900, 33, 1200]
MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox."}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)


def _hf_prompt_logprobs(path, ids: list[int]) -> list[float]:
    """log P(token i | tokens before i) for i >= 1, from transformers."""
    ref = hf_logprobs(path, ids)
    return [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json={"model": SERVED_NAME, **body}, timeout=30)


# ---- echo ----------------------------------------------------------------------------------


def test_echo_prepends_the_prompt(client, llm):
    expected = llm.generate(PROMPT, GREEDY)[0].outputs[0].text
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        echo=True,
        temperature=0,
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].text == PROMPT + expected
    # Token-id prompts echo as their decoded text (vLLM decodes them too); with n and batches,
    # each choice echoes its own prompt.
    prompts = [IDS, IDS[:3]]
    outs = [o.outputs[0].text for o in llm.generate(prompts, GREEDY)]
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt=prompts,
        n=2,
        echo=True,
        temperature=0,
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    decoded = [llm.tokenizer.decode(p) for p in prompts]
    assert [c.text for c in resp.choices] == [decoded[i // 2] + outs[i // 2] for i in range(4)]


def test_echo_logprobs_equal_transformers(client, llm, tiny_qwen3_path):
    """lm-eval's loglikelihood request: token ids, echo, logprobs=1, max_tokens=1."""
    resp = client.completions.create(
        model=SERVED_NAME, prompt=IDS, echo=True, logprobs=1, temperature=0, max_tokens=1
    )
    lp = resp.choices[0].logprobs
    num_tokens = len(IDS) + 1  # the prompt, then the generated token
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(IDS)] == [llm.tokenizer.decode([t]) for t in IDS]
    ref = _hf_prompt_logprobs(tiny_qwen3_path, IDS)
    assert lp.token_logprobs[1 : len(IDS)] == pytest.approx(ref, abs=1e-3)
    # The generated token last, as the engine scores it.
    generated = llm.generate([IDS], GREEDY)[0].outputs[0]
    first = generated.token_ids[0]
    assert lp.tokens[-1] == llm.tokenizer.decode([first])
    assert lp.token_logprobs[-1] == pytest.approx(generated.logprobs[0][first], abs=1e-4)
    # top_logprobs: the token itself plus at most one other (logprobs=1).
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(value)
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets


def test_max_tokens_zero_with_echo_returns_the_prompt_only(client, llm, tiny_qwen3_path):
    resp = client.completions.create(
        model=SERVED_NAME, prompt=IDS, echo=True, logprobs=2, max_tokens=0
    )
    choice = resp.choices[0]
    assert choice.text == llm.tokenizer.decode(IDS)
    assert len(choice.logprobs.tokens) == len(IDS)
    ref = _hf_prompt_logprobs(tiny_qwen3_path, IDS)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(ref, abs=1e-3)
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 1  # vLLM counts the one token the engine ran
    # Echo alone: the prompt's text, no logprobs, and no prompt logprobs computed.
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, echo=True, max_tokens=0)
    assert resp.choices[0].text == PROMPT and resp.choices[0].logprobs is None
    # Without echo: vLLM's 400.
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1, got 0"):
        client.completions.create(model=SERVED_NAME, prompt=IDS, max_tokens=0)


def test_streamed_echo_reassembles_to_the_whole_response(client):
    kwargs = dict(
        model=SERVED_NAME,
        prompt=PROMPT,
        echo=True,
        logprobs=2,
        temperature=0,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
    assert chunks[0].text.startswith(PROMPT)  # the prompt goes out with the first chunk
    assert "".join(c.text for c in chunks) == whole.text
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [x for c in chunks if c.logprobs for x in getattr(c.logprobs, name)]
        assert streamed == getattr(whole.logprobs, name), name
    # max_tokens=0: the prompt only, streamed too.
    kwargs["max_tokens"] = 0
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(c.text for c in chunks) == PROMPT
    assert chunks[-1].finish_reason == "length"


# ---- prompt_logprobs ------------------------------------------------------------------------


def _check_prompt_logprobs(prompt_logprobs, ids: list[int], k: int, path) -> None:
    """vLLM's shape: None, then per token {token_id: {logprob, rank, decoded_token}}."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    ref = _hf_prompt_logprobs(path, ids)
    for entry, token_id, expected in zip(prompt_logprobs[1:], ids[1:], ref):
        assert str(token_id) in entry and k <= len(entry) <= k + 1
        assert entry[str(token_id)]["logprob"] == pytest.approx(expected, abs=1e-3)
        ranked = sorted(entry.values(), key=lambda v: v["rank"] or k + 1)
        assert [v["rank"] for v in ranked][:k] == list(range(1, k + 1))
        assert all(v["decoded_token"] is not None for v in entry.values())


def test_prompt_logprobs_completions(client, fake, tiny_qwen3_path):
    resp = client.completions.create(
        model=SERVED_NAME, prompt=IDS, max_tokens=2, extra_body={"prompt_logprobs": 3}
    )
    assert fake.record.requests[0].params.prompt_logprobs == 3
    _check_prompt_logprobs(resp.choices[0].prompt_logprobs, IDS, 3, tiny_qwen3_path)
    # Not asked: null, as vLLM returns it.
    resp = client.completions.create(model=SERVED_NAME, prompt=IDS, max_tokens=2)
    assert resp.choices[0].prompt_logprobs is None


def test_prompt_logprobs_chat(client, llm, tiny_qwen3_path):
    resp = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    ids = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(getattr(ids, "input_ids", ids))
    assert resp.usage.prompt_tokens == len(ids)
    _check_prompt_logprobs(resp.prompt_logprobs, ids, 0, tiny_qwen3_path)


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_prompt_logprobs_errors(gateway_url, fake, path):
    body = {"prompt": "Hi"} if path == "completions" else {"messages": MESSAGES}
    cases = [
        ({"prompt_logprobs": 1, "stream": True}, "`prompt_logprobs` are not available when"),
        ({"prompt_logprobs": 0, "stream": True}, "`prompt_logprobs` are not available when"),
        ({"prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1."),
        (
            {"prompt_logprobs": 21},
            "Requested prompt logprobs of 21, which is greater than max allowed: 20",
        ),
        ({"prompt_logprobs": -1}, "Requested prompt logprobs of 2048, which is greater than"),
    ]
    for fields, message in cases:
        resp = _post(gateway_url, path, {**body, **fields})
        assert resp.status_code == 400, (fields, resp.text)
        assert resp.json()["error"]["message"].startswith(message), resp.text
    assert fake.record.requests == []


def test_echo_logprobs_above_the_limit_are_refused(gateway_url, fake):
    resp = _post(gateway_url, "completions", {"prompt": "Hi", "echo": True, "logprobs": 21})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("Requested sample logprobs of 21")
    assert fake.record.requests == []


# ---- logit_bias -----------------------------------------------------------------------------


def test_logit_bias_reaches_the_decode_clamped(client, fake):
    client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=1, logit_bias={"7": 1000, "9": -3.5}
    )
    client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=1, logit_bias={"7": -1000}
    )
    biases = [dict(r.params.logit_bias) for r in fake.record.requests]
    assert biases == [{7: 100.0, 9: -3.5}, {7: -100.0}]  # clamped to [-100, 100], as vLLM


def test_logit_bias_forces_a_token(client, llm):
    """The engine's effect: +100 on one token makes greedy decoding pick it every time."""
    token = llm.tokenizer.decode([7])
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        temperature=0,
        max_tokens=4,
        logit_bias={"7": 100},
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].logprobs.tokens == [token] * 4
    resp = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        temperature=0,
        max_tokens=4,
        logit_bias={"7": 100},
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    assert [e.token for e in resp.choices[0].logprobs.content] == [token] * 4


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_logit_bias_errors(gateway_url, fake, path):
    body = {"prompt": "Hi"} if path == "completions" else {"messages": MESSAGES}
    cases = [
        ({"abc": 1}, "logit_bias keys must be token ids"),
        (
            {"5": 1, "2048": 1, "-1": 2},
            "token_id(s) [2048, -1] in logit_bias contain out-of-vocab token ids. "
            "Vocabulary size: 2048",
        ),
    ]
    for bias, message in cases:
        resp = _post(gateway_url, path, {**body, "logit_bias": bias})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["message"].startswith(message) and error["param"] == "logit_bias"
    resp = _post(gateway_url, path, {**body, "logit_bias": {"5": "1"}})
    assert resp.status_code == 400 and "logit_bias" in resp.json()["error"]["message"]
    assert fake.record.requests == []
