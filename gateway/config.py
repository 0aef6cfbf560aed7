"""Gateway settings: the one typed place where flags and `TANDEM_GATEWAY_*` variables meet.

`pydantic-settings` lives only here, at the edge (STYLE.md principle 6). The CLI in
`gateway.__main__` passes explicit flags as keyword arguments; anything not given falls back to
the environment, then to the defaults below.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _split_addresses(value: object) -> object:
    """`"h1:p1, h2:p2"` (flag or env) → `["h1:p1", "h2:p2"]`; lists pass through."""
    if isinstance(value, str):
        return [a.strip() for a in value.split(",") if a.strip()]
    return value


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_GATEWAY_", frozen=True)

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

    @field_validator("served_model_name", "decode", "prefill", mode="before")
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

    @model_validator(mode="after")
    def _default_served_name(self) -> GatewaySettings:
        if not self.served_model_name:
            # vLLM: the served name defaults to the --model argument as given.
            object.__setattr__(self, "served_model_name", [self.model])
        return self
