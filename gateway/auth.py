"""API keys → principals (tenant, trust group, limits), looked up by their SHA-256 digest.

Keys come from `TANDEM_API_KEYS` (`key` or `key:tenant`, comma-separated) and/or the file named
by `TANDEM_API_KEYS_FILE` (one `key[:tenant[:limits-json]]` per line, `#` comments), never from
argv. Only SHA-256 digests are kept. A presented key is hashed and its digest looked up in a
dict: one lookup whatever the number of keys (a scan with `hmac.compare_digest` over every
digest cost 43 us per request at 1,000 keys and 0.43 ms at 10,000, and the duplicate check made
loading quadratic). Timing is safe all the same: what the lookup's time can depend on is the
digest of what was presented and how it compares with stored digests, never the bytes of a key,
and knowing a digest (even a whole stored one) does not give a key that hashes to it.

Neither variable set: auth is off (the gateway says so loudly). One set but holding no key (empty,
blank, only commas or `#` comments, an empty file) is an error, not "auth off": the gateway
refuses to start, since that is a slip far more often than a choice.

Nothing here ever puts a key, or a field of a line that might be one, into a message: parse
errors name the source and line number only. A key without a tenant belongs to the tenant
"default" (several bare keys = one tenant rotating its keys). Limits left out of a line come
from the `default_*` settings; 0 means unlimited.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass

from gateway.config import GatewaySettings

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_TENANT_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_MIN_KEY_LEN = 16  # shorter keys are accepted with a warning: guessable
_LIMIT_FIELDS = ("requests_per_min", "tokens_per_min", "max_concurrent", "max_tokens", "max_n")


@dataclass(frozen=True)
class TenantLimits:
    """Per-key limits; 0 means unlimited (max_tokens: up to max_model_len)."""

    requests_per_min: int = 0
    tokens_per_min: int = 0
    max_concurrent: int = 0
    max_tokens: int = 0
    max_n: int = 128

    @property
    def has_window_limits(self) -> bool:
        """Whether admission needs the quota backend at all (else no Redis round trip)."""
        return bool(self.requests_per_min or self.tokens_per_min or self.max_concurrent)


@dataclass(frozen=True)
class Principal:
    """Who is calling. `quota_id` names the key's quota buckets; it is derived from the key with
    its own domain prefix, so it is not the stored digest (nor a prefix of it)."""

    tenant: str
    limits: TenantLimits
    quota_id: str
    trust_group: str | None = None
    is_anonymous: bool = False

    @property
    def cache_salt(self) -> str:
        """Prefix-cache isolation: tenants share cached blocks only inside one trust group.
        The prefixes keep a tenant and a trust group of the same name apart."""
        if self.trust_group:
            return f"group:{self.trust_group}"
        return f"tenant:{self.tenant}"


def anonymous(settings: GatewaySettings) -> Principal:
    """The caller when auth is off: default limits, one shared quota bucket."""
    return Principal("anonymous", default_limits(settings), "anonymous", is_anonymous=True)


def default_limits(settings: GatewaySettings) -> TenantLimits:
    return TenantLimits(
        requests_per_min=settings.default_requests_per_min,
        tokens_per_min=settings.default_tokens_per_min,
        max_concurrent=settings.default_max_concurrent,
        max_tokens=settings.default_max_tokens,
        max_n=settings.default_max_n,
    )


class KeyStore:
    """Digest → principal. Empty store: auth is off."""

    def __init__(self, by_digest: dict[bytes, Principal]):
        self._by_digest = by_digest

    @property
    def is_enabled(self) -> bool:
        return bool(self._by_digest)

    def authenticate(self, presented: bytes) -> Principal | None:
        """The principal whose key is `presented` (raw header bytes), or None."""
        return self._by_digest.get(hashlib.sha256(presented).digest())

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> KeyStore:
        """The keys of `TANDEM_API_KEYS` and `TANDEM_API_KEYS_FILE`. Neither set: an empty store
        (auth off, announced by the caller). One set but holding no key (empty, blank, commas,
        only comments, an empty file) is a ValueError: a slip must not silently turn auth off."""
        defaults = default_limits(settings)
        # (what is set, how to unset it, its lines: (where, text, may it set limits))
        sources: list[tuple[str, str, list[tuple[str, str, bool]]]] = []
        if settings.api_keys is not None:
            items = settings.api_keys.get_secret_value().split(",")
            lines = [(f"TANDEM_API_KEYS entry {i}", t, False) for i, t in enumerate(items, 1)]
            sources.append(("TANDEM_API_KEYS", "unset TANDEM_API_KEYS", lines))
        if settings.api_keys_file is not None:
            try:
                text = settings.api_keys_file.read_text()
            except OSError as e:
                raise ValueError(f"cannot read TANDEM_API_KEYS_FILE: {e.strerror}") from None
            lines = [
                (f"TANDEM_API_KEYS_FILE line {i}", t, True)
                for i, t in enumerate(text.splitlines(), 1)
            ]
            what = f"TANDEM_API_KEYS_FILE ({settings.api_keys_file})"
            sources.append((what, "unset TANDEM_API_KEYS_FILE / drop --api-keys-file", lines))
        entries: dict[bytes, Principal] = {}
        groups: dict[str, str | None] = {}  # tenant -> its trust group
        for what, how_to_unset, lines in sources:
            num_entries_before = len(entries)
            for where, text, allow_limits in lines:
                _add_line(entries, groups, where, text.strip(), defaults, allow_limits)
            if len(entries) == num_entries_before:
                raise ValueError(
                    f"{what} is set but holds no key (only blanks, commas or # comments); the "
                    "gateway refuses to start rather than serve without auth. Give at least one "
                    f"key, or {how_to_unset} to run without auth explicitly (every request is "
                    "then served without a key)."
                )
        return cls(entries)


def _add_line(
    entries: dict[bytes, Principal],
    groups: dict[str, str | None],
    where: str,
    text: str,
    defaults: TenantLimits,
    allow_limits: bool,
) -> None:
    """Parse one stripped line into `entries` (blank lines and `#` comments add nothing)."""
    if not text or text.startswith("#"):
        return
    key, principal = _parse_line(text, where, defaults, allow_limits=allow_limits)
    digest = hashlib.sha256(key.encode()).digest()
    if digest in entries:
        raise ValueError(f"{where}: duplicate key")
    if groups.setdefault(principal.tenant, principal.trust_group) != principal.trust_group:
        raise ValueError(f"{where}: tenant has a different trust_group on another line")
    if len(key) < _MIN_KEY_LEN:
        logger.warning("%s: key is shorter than %d characters", where, _MIN_KEY_LEN)
    entries[digest] = principal


def _parse_line(
    text: str, where: str, defaults: TenantLimits, *, allow_limits: bool
) -> tuple[str, Principal]:
    """`key[:tenant[:limits-json]]` → (key, principal). Errors never quote the line."""
    parts = text.split(":", 2)
    if len(parts) == 3 and not allow_limits:
        raise ValueError(f"{where}: limits can only be set in TANDEM_API_KEYS_FILE")
    key = parts[0].strip()
    tenant = parts[1].strip() if len(parts) > 1 else DEFAULT_TENANT
    if not key:
        raise ValueError(f"{where}: empty key")
    if not _TENANT_RE.match(tenant):
        raise ValueError(f"{where}: tenant must match {_TENANT_RE.pattern}")
    limits, trust_group = defaults, None
    if len(parts) == 3:
        limits, trust_group = _parse_limits(parts[2], where, defaults)
    quota_id = hashlib.sha256(b"tandem.quota.v1\0" + key.encode()).hexdigest()[:32]
    return key, Principal(tenant, limits, quota_id, trust_group)


def _parse_limits(text: str, where: str, defaults: TenantLimits) -> tuple[TenantLimits, str | None]:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"{where}: limits are not valid JSON") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: limits must be a JSON object")
    unknown = sorted(set(raw) - {*_LIMIT_FIELDS, "trust_group"})
    if unknown:
        raise ValueError(f"{where}: unknown limit field(s) {unknown}; known: {_LIMIT_FIELDS}")
    values = {}
    for name in _LIMIT_FIELDS:
        if name in raw:
            value, lowest = raw[name], 1 if name == "max_n" else 0
            if type(value) is not int or value < lowest:
                raise ValueError(f"{where}: {name} must be an integer >= {lowest}")
            values[name] = value
    trust_group = raw.get("trust_group")
    if trust_group is not None and not (
        isinstance(trust_group, str) and _TENANT_RE.match(trust_group)
    ):
        raise ValueError(f"{where}: trust_group must match {_TENANT_RE.pattern}")
    return dataclasses.replace(defaults, **values), trust_group
