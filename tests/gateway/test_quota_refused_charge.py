"""A request refused or failed after validation still costs its prompt tokens.

Reviewer's finding: 128 prompts x 1,500 token ids with max_tokens 1 came back 503 and nothing
was charged to the tenant's tokens-per-minute, so the same request could be repeated at once,
keeping the prefill pool busy for free.
"""

from __future__ import annotations

import httpx

from tests.gateway.conftest import SERVED_NAME
from tests.gateway.edge_util import KEY_ALPHA, wait_for
from tests.gateway.test_quota_gateway import _redis_state, limited  # noqa: F401
from tests.redis_server import redis_server  # noqa: F401  (fixture)


def test_refused_requests_are_charged_their_prompt_tokens(limited, redis_server, fake):  # noqa: F811
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12]] * 4  # 32 prompt tokens
    body = {"model": SERVED_NAME, "prompt": prompts, "max_tokens": 1}
    auth = {"Authorization": f"Bearer {KEY_ALPHA}"}
    with limited({"tokens_per_min": 100}) as (url, state):
        fake.knobs.refuse = True  # every decode is busy: 503 at admission
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=auth)
        assert resp.status_code == 503
        wait_for(lambda: _redis_state(redis_server, state) == (32, 0), timeout_s=5.0)
        for _ in range(2):
            assert httpx.post(f"{url}/v1/completions", json=body, headers=auth).status_code == 503
        wait_for(lambda: _redis_state(redis_server, state)[0] == 96, timeout_s=5.0)
        # 96 + 36 reserved > 100: the fourth try is refused by the quota, not sent.
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=auth)
        assert resp.status_code == 429
