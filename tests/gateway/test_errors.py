"""Errors in OpenAI's shape with vLLM's wording, so the openai SDK raises the right class."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME

MESSAGES = [{"role": "user", "content": "Hi"}]


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == resp.status_code
    return body["error"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.body["message"] == "The model `nope` does not exist."
    assert info.value.body["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_max_tokens_too_large_is_400_with_numbers(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt=[5, 6, 7, 8, 9], max_tokens=300)
    assert info.value.body["message"] == (
        f"'max_tokens' is too large: 300. This model's maximum context length is {MAX_MODEL_LEN} "
        f"tokens and your request has 5 input tokens (300 > {MAX_MODEL_LEN} - 5)."
    )
    assert info.value.body["type"] == "BadRequestError"


def test_prompt_too_long_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt=[5] * 300)
    assert info.value.body["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request "
        "has 300 input tokens. Please reduce the length of the input messages."
    )


def test_bad_sampling_params_are_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, top_p=1.5)
    assert info.value.body["message"] == "top_p must be in (0, 1], got 1.5."
    with pytest.raises(openai.BadRequestError, match="temperature must be non-negative"):
        client.completions.create(model=SERVED_NAME, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="greater than max allowed: 20"):
        client.completions.create(model=SERVED_NAME, prompt="x", logprobs=21)


def test_validation_errors_are_400_not_422(gateway_url):
    url = f"{gateway_url}/v1/chat/completions"
    resp = httpx.post(url, json={"model": SERVED_NAME})  # no messages
    assert resp.status_code == 400
    assert "messages" in _error(resp)["message"] and _error(resp)["type"] == "BadRequestError"
    resp = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400
    resp = httpx.post(url, json={"messages": MESSAGES, "stream_options": {"include_usage": True}})
    assert resp.status_code == 400
    assert "only be defined when `stream=True`" in _error(resp)["message"]
    resp = httpx.post(f"{gateway_url}/v1/completions", json={"prompt": [[1], "a"]})
    assert resp.status_code == 400


def test_out_of_vocab_token_is_400(client):
    with pytest.raises(openai.BadRequestError, match="Token id 99999 is out of vocabulary"):
        client.completions.create(model=SERVED_NAME, prompt=[1, 99999], max_tokens=2)


@pytest.mark.parametrize("as_event", [False, True])
def test_refusal_is_503_with_retry_after(client, gateway_url, fake, as_event):
    if as_event:
        fake.knobs.refuse_as_event = True
    else:
        fake.knobs.refuse = True
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=2)
    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"] == "1"
    assert "busy" in info.value.body["message"]
    # Streaming requests fail the same way: the status is decided before the first byte.
    resp = httpx.post(
        f"{gateway_url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}
    )
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    _error(resp)


# The decode's own message ("boom": an engine exception's text) is logged, never sent.
DECODE_FAILED = "The model server failed while generating this response"


def test_error_mid_stream_is_an_sse_error_event(gateway_url, client, fake, caplog):
    fake.knobs.fail_after_tokens = 3
    body = {"prompt": "Hello", "max_tokens": 10, "ignore_eos": True, "stream": True}
    with caplog.at_level("WARNING", logger="gateway"):
        with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert events[-2].startswith('data: {"error":') and DECODE_FAILED in events[-2]
    assert "boom" not in events[-2] and "DECODE_FAILED" not in events[-2]
    assert any("DECODE_FAILED: boom" in r.getMessage() for r in caplog.records)
    assert len(events) >= 3  # some text made it out before the failure
    # The SDK turns the event into an exception.
    with pytest.raises(openai.APIError, match=DECODE_FAILED):
        list(
            client.completions.create(
                model=SERVED_NAME,
                prompt="Hello",
                max_tokens=10,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
    # Not streamed: nothing was sent yet, so it is a plain HTTP error.
    with pytest.raises(openai.InternalServerError, match=DECODE_FAILED):
        client.completions.create(
            model=SERVED_NAME, prompt="Hello", max_tokens=10, extra_body={"ignore_eos": True}
        )


def test_error_before_first_token_is_http_error(client, fake):
    fake.knobs.fail_after_tokens = 0
    with pytest.raises(openai.InternalServerError, match=DECODE_FAILED):
        list(
            client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=5, stream=True)
        )
