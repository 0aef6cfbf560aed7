"""The official openai SDK against real prefill/decode/gateway processes (UCX KV handoff)."""

from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from tests.e2e.cluster import deploy

FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "128"]


@pytest.fixture(scope="module")
def dep(tiny_qwen3_path):
    d = deploy(str(tiny_qwen3_path), 1, 1, FLAGS)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def offline(tiny_qwen3_path):
    return LLM(str(tiny_qwen3_path), max_model_len=256, num_gpu_blocks_override=128)


@pytest.fixture
def client(dep):
    return openai.OpenAI(base_url=dep.base_url, api_key="unused", max_retries=0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
MSGS = [{"role": "user", "content": "Tell me about the quick brown fox."}]


def test_chat_greedy_equals_offline(dep, client, offline):
    expected = offline.chat(MSGS, GREEDY)[0]
    r = client.chat.completions.create(
        model=dep.model,
        messages=MSGS,
        temperature=0,
        max_tokens=16,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + 16
    # Streamed: the deltas add up to the same text.
    chunks = client.chat.completions.create(
        model=dep.model,
        messages=MSGS,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
        usage = c.usage or usage
    assert text == expected.outputs[0].text and usage.completion_tokens == 16


def test_completions_greedy_equals_offline(dep, client, offline):
    prompt = "Once upon a time in a land far away"
    expected = offline.generate([prompt], GREEDY)[0].outputs[0].text
    r = client.completions.create(
        model=dep.model,
        prompt=prompt,
        temperature=0,
        max_tokens=16,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == expected
    stream = client.completions.create(
        model=dep.model,
        prompt=prompt,
        temperature=0,
        max_tokens=16,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_kv_handoff_crosses_processes_over_ucx_and_local_is_equal(
    dep, client, offline, tiny_qwen3_path
):
    before_p, before_d = dep.loads("prefill")[0], dep.loads("decode")[0]
    prompt = "A long story about dragons, castles and brave knights who fight them"
    r = client.completions.create(
        model=dep.model, prompt=prompt, temperature=0, max_tokens=8, extra_body={"ignore_eos": True}
    )
    after_p, after_d = dep.loads("prefill")[0], dep.loads("decode")[0]
    assert after_p.kv_backend == after_d.kv_backend == "ucx"
    assert after_d.num_remote_prefills == before_d.num_remote_prefills + 1
    sent = after_p.kv_transfer_bytes - before_p.kv_transfer_bytes
    assert sent > 0 and sent == after_d.kv_transfer_bytes - before_d.kv_transfer_bytes
    # The same request prefilled locally on D (a gateway with no prefill pool).
    local = deploy(str(tiny_qwen3_path), 0, 1, FLAGS)
    try:
        c2 = openai.OpenAI(base_url=local.base_url, api_key="unused", max_retries=0)
        r2 = c2.completions.create(
            model=local.model,
            prompt=prompt,
            temperature=0,
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert local.loads("decode")[0].num_local_prefills == 1
    finally:
        local.stop()
    assert r.choices[0].text == r2.choices[0].text
    assert (
        r.choices[0].text
        == offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[
            0
        ]
        .outputs[0]
        .text
    )


def test_n_with_seed_is_reproducible(dep, client):
    kw = dict(
        model=dep.model,
        prompt="The weather today",
        n=2,
        seed=42,
        temperature=1.0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    assert a.usage.completion_tokens == 24


def test_stop_strings(dep, client, offline):
    prompt = "Hello, my name is"
    full = (
        offline.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    stop = full[6:9]
    assert stop.strip()
    r = client.completions.create(
        model=dep.model,
        prompt=prompt,
        temperature=0,
        max_tokens=16,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    dep.wait_idle()  # the decode was aborted at the stop string: its blocks are free


def test_errors(dep, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"maximum context length is 256"):
        client.completions.create(model=dep.model, prompt="hi", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=dep.model, prompt="hi", max_tokens=4, top_p=7)


def test_prefix_reuse_counts_hits_and_keeps_output(dep, client, offline):
    history = [{"role": "user", "content": "Count the animals: cat dog bird fish cow horse " * 4}]
    r1 = client.chat.completions.create(
        model=dep.model,
        messages=history,
        temperature=0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )

    def total_hits() -> int:  # KV-aware routing may prefill on P or, holding the prefix, on D
        return sum(ld.prefix_cache_hits for r in ("prefill", "decode") for ld in dep.loads(r))

    before = total_hits()
    follow = history + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And now?"},
    ]
    r2 = client.chat.completions.create(
        model=dep.model,
        messages=follow,
        temperature=0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    hits = total_hits() - before
    assert hits >= 48
    assert r2.usage.prompt_tokens_details.cached_tokens >= 48
    expected = offline.chat(follow, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert r2.choices[0].message.content == expected[0].outputs[0].text


def test_503_when_every_decode_refuses(tiny_qwen3_path):
    d = deploy(str(tiny_qwen3_path), 0, 1, FLAGS, decode_flags=["--max-num-queued-reqs", "0"])
    try:
        c = openai.OpenAI(base_url=d.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=d.model, prompt="hi", max_tokens=4)
        assert e.value.status_code == 503
        assert e.value.response.headers.get("retry-after")
    finally:
        d.stop()
