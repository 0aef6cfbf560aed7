"""Gateway settings: the one typed place where flags and `TANDEM_GATEWAY_*` variables meet.

`pydantic-settings` lives only here, at the edge (STYLE.md principle 6). The CLI in
`gateway.__main__` passes explicit flags as keyword arguments; anything not given falls back to
the environment, then to the defaults below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.reasoning import check_reasoning_parser_name
from gateway.tool_parsers import check_tool_parser_name


def _split_addresses(value: object) -> object:
    """`"h1:p1, h2:p2"` (flag or env) → `["h1:p1", "h2:p2"]`; lists pass through."""
    if isinstance(value, str):
        return [a.strip() for a in value.split(",") if a.strip()]
    return value


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TANDEM_GATEWAY_", frozen=True, populate_by_name=True
    )

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Local folder or hub id; the gateway needs only its tokenizer and configs, not weights.
    model: str
    # Names clients may put in `model`; the first is the one /v1/models reports.
    served_model_name: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # None: the model config's max_position_embeddings (as the engine derives it).
    max_model_len: int | None = Field(None, ge=1)
    decode: Annotated[list[str], NoDecode] = Field(default_factory=list)
    prefill: Annotated[list[str], NoDecode] = Field(default_factory=list)
    trust_remote_code: bool = False

    # An instance whose call failed with UNAVAILABLE is skipped for this long.
    unhealthy_cooldown_s: float = Field(5.0, ge=0)
    # Sent as `Retry-After` with 503s: roughly how long a full decode pool takes to drain a bit.
    retry_after_s: int = Field(1, ge=0)
    # /health: how long to wait for a decode's GetLoad answer.
    health_timeout_s: float = Field(1.0, gt=0)
    # Time to get the first stream message (admission) from one decode before trying the next.
    admission_timeout_s: float = Field(600.0, gt=0)
    # vLLM's default max_logprobs.
    max_logprobs: int = Field(20, ge=0)

    # Routing. With `redis_url` (below) instances are discovered in Redis and the block index
    # lives there; without it, the --decode/--prefill lists and an embedded index.
    # "kv": KV-aware (P, D) selection (gateway/kv_router.py); "round_robin": the first cut.
    router: Literal["kv", "round_robin"] = "kv"
    # "auto": the cost model prefills on D when P/D does not pay; "remote": always on a prefill
    # instance while one is healthy (pure disaggregation, for comparisons).
    prefill_policy: Literal["auto", "remote"] = "auto"
    # One JSON line per request: the route, its predicted and measured TTFT (gateway/kv_router.py).
    route_log: str | None = None
    # How often the Redis registry is re-read (new and dead instances show up this fast).
    registry_refresh_s: float = Field(0.25, gt=0)

    # --- The edge: auth, allowlist, quotas, metrics (gateway.auth, .allowlist, .quota, .metrics).
    # Shared state (quotas; the instance registry and block index use it too). Not prefixed:
    # every Tandem process reads the same TANDEM_REDIS_URL.
    redis_url: str | None = Field(None, validation_alias="TANDEM_REDIS_URL")
    # API keys come from the environment or a mounted file, never from argv (visible in `ps`).
    # `key` or `key:tenant`, comma-separated; SecretStr keeps them out of reprs and errors.
    # Neither set: auth off. Set but holding no key: the gateway refuses to start (gateway.auth).
    api_keys: SecretStr | None = Field(None, validation_alias="TANDEM_API_KEYS")
    # One `key[:tenant[:limits-json]]` per line, `#` comments (see gateway.auth).
    api_keys_file: Path | None = Field(None, validation_alias="TANDEM_API_KEYS_FILE")
    # Reachable without a key when keys are configured: vLLM's unauthenticated routes (/health,
    # /version; /version is what the liveness probes ask). The model list is behind the key, as
    # in vLLM and OpenAI (TANDEM_GATEWAY_PUBLIC_MODELS=true opens it).
    public_health: bool = True
    public_models: bool = False
    # vLLM's POST /tokenize and /detokenize; off: they are 404 like any unlisted path.
    enable_tokenizer_endpoints: bool = False
    # CORS is closed unless origins are listed (browsers then get no Access-Control headers).
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Bodies above this are refused with 413 before they are parsed.
    max_request_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # --- One request never blocks the event loop (gateway/offload.py). Parsing, chat templating
    # and tokenization run in a thread pool; these bound what one request can cost there.
    # A chat with more messages is refused before its messages are validated (pydantic holds
    # the GIL ~5 us per message: 4096 messages is ~20 ms of event-loop time at most).
    max_messages: int = Field(4096, ge=1)
    # More stop strings are refused (vLLM-style 400): each is matched against every new text.
    max_stop_strings: int = Field(256, ge=1)
    # Parsing + templating + tokenizing one request longer than this is a 400 (the worker thread
    # finishes in the background; the size bounds above keep that finite).
    tokenize_timeout_s: float = Field(30.0, gt=0)
    preprocess_workers: int = Field(4, ge=1)
    # vLLM's --trust-request-chat-template: without it a request's own `chat_template` (a Jinja
    # program run by the gateway) is refused.
    trust_request_chat_template: bool = False
    # Tool calling and reasoning, vLLM's flags (gateway/chat_tools.py, gateway/chat_output.py):
    # tool_choice "auto" needs both of the first two; the parsers are looked up by name.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # gateway.tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # gateway.reasoning.REASONING_PARSERS
    # tool_choice "none": leave the tools out of the prompt (vLLM renders them by default).
    exclude_tools_when_tool_choice_none: bool = False
    # Prometheus on its own port (None: off; 0: any free port); never on the public port.
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    # Per-key limits for keys whose line does not set them; 0 means unlimited.
    default_requests_per_min: int = Field(0, ge=0)
    default_tokens_per_min: int = Field(0, ge=0)
    default_max_concurrent: int = Field(0, ge=0)
    default_max_tokens: int = Field(0, ge=0)  # cap on a request's max_tokens (0: max_model_len)
    default_max_n: int = Field(128, ge=1)  # OpenAI's cap; each sample is a child job
    # A concurrency slot in Redis expires unless renewed (a crashed gateway cannot leak slots).
    concurrency_lease_s: float = Field(30.0, gt=0)
    # Redis calls slower than this count as "Redis down" (fall back to in-memory quotas).
    redis_timeout_s: float = Field(0.5, gt=0)
    # While degraded, how often to check whether Redis is back.
    redis_probe_interval_s: float = Field(1.0, gt=0)
    # --- Load shedding (gateway/shedding.py): past a bound on the requests in flight in this
    # process, a new POST gets 503 + Retry-After. The bound shrinks while the event loop's thread
    # is busy (running, or waiting for a CPU) more than this share of the time (0: off) ...
    shed_busy_fraction: float = Field(0.9, ge=0, le=1)
    # ... and never exceeds this fixed cap (0: none).
    max_inflight_requests: int = Field(0, ge=0)

    @field_validator("served_model_name", "decode", "prefill", "cors_origins", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return _split_addresses(value)

    @field_validator("decode", "prefill")
    @classmethod
    def _check_addresses(cls, value: list[str]) -> list[str]:
        for address in value:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"instance address {address!r} is not host:port")
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _check_tool_call_parser(cls, value: str | None) -> str | None:
        return None if value is None else check_tool_parser_name(value)

    @field_validator("reasoning_parser")
    @classmethod
    def _check_reasoning_parser(cls, value: str | None) -> str | None:
        return None if value is None else check_reasoning_parser_name(value)

    @model_validator(mode="after")
    def _auto_tool_choice_needs_a_parser(self) -> GatewaySettings:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        return self

    @model_validator(mode="after")
    def _default_served_name(self) -> GatewaySettings:
        if not self.served_model_name:
            # vLLM: the served name defaults to the --model argument as given.
            object.__setattr__(self, "served_model_name", [self.model])
        return self
