"""Authenticated records in Redis: the registry and the block-location sets.

Redis is shared state, not a root of trust: anyone who can write to it could otherwise make the
gateways route tenants' prompts (and the internal token, and a decode's KV metadata) to a
process of their choosing. So every record a service writes is sealed with an HMAC whose key
is derived from the internal secret (`TANDEM_INTERNAL_TOKEN[_FILE]`), which Redis never sees:

- instance records: `<hex HMAC-SHA256>.<json>`; a reader verifies the MAC (constant time) and
  the schema (`engine.registry.InstanceRecord.from_json`), and skips, counts and logs (once) a
  record that fails either: one bad record never stops discovery of the others;
- block-set members: not the raw chained block hashes but a keyed BLAKE2b digest of each, so a
  writer without the key cannot claim a prompt's blocks (nor read which prompts are cached).

Keys are derived per use (`tandem.registry.v1`, `tandem.blocks.v1`), so one never doubles as the
other or as the token itself. Without an internal secret (`--insecure-internal`) records are
sealed with a key everyone knows: malformed records are still rejected, forged ones are not.
"""

from __future__ import annotations

import hashlib
import hmac

from engine.internal_auth import internal_token

_REGISTRY_LABEL = b"tandem.registry.v1"
_BLOCKS_LABEL = b"tandem.blocks.v1"
_MAC_HEX_LEN = 64
BLOCK_MEMBER_BYTES = 16


class RecordError(ValueError):
    """A record that is not authentic or not well-formed."""


class RecordAuth:
    def __init__(self, secret: str | None):
        self.is_authenticated = secret is not None
        root = (secret or "").encode()
        self._registry_key = hmac.new(root, _REGISTRY_LABEL, hashlib.sha256).digest()
        self._blocks_key = hmac.new(root, _BLOCKS_LABEL, hashlib.sha256).digest()

    @classmethod
    def from_env(cls) -> RecordAuth:
        return cls(internal_token())

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._registry_key, payload, hashlib.sha256).hexdigest().encode()

    def seal(self, payload: bytes) -> bytes:
        return self._mac(payload) + b"." + payload

    def open(self, sealed: bytes) -> bytes:
        """The payload of a sealed record; RecordError when the MAC is missing or wrong."""
        if not isinstance(sealed, bytes | bytearray) or len(sealed) <= _MAC_HEX_LEN + 1:
            raise RecordError("not a sealed record (too short)")
        mac, dot, payload = (
            sealed[:_MAC_HEX_LEN],
            sealed[_MAC_HEX_LEN : _MAC_HEX_LEN + 1],
            sealed[_MAC_HEX_LEN + 1 :],
        )
        if dot != b"." or not hmac.compare_digest(bytes(mac), self._mac(bytes(payload))):
            raise RecordError("bad MAC: not written by a holder of the internal secret")
        return bytes(payload)

    def block_member(self, block_hash: bytes) -> bytes:
        """What a block set holds for `block_hash` (see the module docstring)."""
        return hashlib.blake2b(
            block_hash, key=self._blocks_key, digest_size=BLOCK_MEMBER_BYTES
        ).digest()
