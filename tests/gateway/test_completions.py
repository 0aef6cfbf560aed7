"""Completions: text, token ids, and batches of either, through the gateway."""

from __future__ import annotations

from engine import SamplingParams
from tests.gateway.conftest import SERVED_NAME

PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
EXTRA = {"ignore_eos": True}


def test_text_prompt_matches_offline(client, llm):
    expected = llm.generate(PROMPT, GREEDY)[0]
    resp = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, temperature=0, max_tokens=16, extra_body=EXTRA
    )
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == expected.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == 16


def test_batch_of_token_id_prompts(client, llm):
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    expected = [o.outputs[0].text for o in llm.generate(prompts, GREEDY)]
    resp = client.completions.create(
        model=SERVED_NAME, prompt=prompts, temperature=0, max_tokens=16, extra_body=EXTRA
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == expected
    assert resp.usage.prompt_tokens == 7 and resp.usage.completion_tokens == 32
    single = client.completions.create(
        model=SERVED_NAME, prompt=prompts[1], temperature=0, max_tokens=16, extra_body=EXTRA
    )
    assert single.choices[0].text == expected[1]


def test_batch_of_text_prompts_with_n(client, llm):
    prompts = [PROMPT, "Hello, world!"]
    resp = client.completions.create(
        model=SERVED_NAME, prompt=prompts, n=2, temperature=0, max_tokens=16, extra_body=EXTRA
    )
    expected = [o.outputs[0].text for o in llm.generate(prompts, GREEDY)]
    # Choice i answers prompt i // n.
    assert [c.text for c in resp.choices] == [expected[0]] * 2 + [expected[1]] * 2


def test_stream_with_usage(client, llm):
    expected = llm.generate(PROMPT, GREEDY)[0].outputs[0].text
    chunks = list(
        client.completions.create(
            model=SERVED_NAME,
            prompt=PROMPT,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_no_usage_chunk_unless_asked(client):
    chunks = list(
        client.completions.create(
            model=SERVED_NAME, prompt=PROMPT, max_tokens=4, stream=True, extra_body=EXTRA
        )
    )
    assert all(c.usage is None and c.choices for c in chunks)


def test_logprobs(client):
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        temperature=0,
        max_tokens=6,
        logprobs=2,
        extra_body=EXTRA,
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_stop_string(client, llm):
    full = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    text = full[0].outputs[0].text
    stop = text[5:8]
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        temperature=0,
        max_tokens=30,
        stop=stop,
        extra_body=EXTRA,
    )
    assert resp.choices[0].text == text[: text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
