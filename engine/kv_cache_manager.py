"""Per-request block tables on top of the block pool.

The scheduler sees only this interface: how many leading tokens of a request are already
cached, whether slots for N more tokens can be allocated, and freeing. Block lists stay inside;
the model runner reads block ids through `get_block_ids`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from engine.block_pool import BlockPool, KVCacheBlock
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Token counts, as vLLM's `prefix_cache_queries` / `prefix_cache_hits` counters."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # the same, as ids: read every step
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        self.quarantined: dict[str, list[KVCacheBlock]] = {}
        self._quarantine_ids = itertools.count()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in order. The manager's own list: read it, do not keep it
        across steps or change it."""
        return self.req_to_block_ids.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of leading full blocks already in the cache, and its token count.

        At least the last prompt token is always recomputed: its logits give the next token.
        Requests asking for prompt logprobs skip the cache (they need every position's logits).
        """
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_stats.queries += request.num_tokens
        self.prefix_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` after the request's computed (and newly hit) tokens.

        Returns False, changing nothing, when the pool cannot supply enough blocks.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Hit blocks that sit in the free queue stop being allocatable once we touch them.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        self.pool.touch(new_computed_blocks)
        ids = self.req_to_block_ids.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        ids.extend(b.block_id for b in new_computed_blocks)
        if num_new_blocks > 0:
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            ids.extend(b.block_id for b in new_blocks)
        self.num_cached_blocks.setdefault(request.request_id, len(new_computed_blocks))
        return True

    def cache_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose KV is now computed to the prefix cache."""
        if not self.enable_caching:
            return
        # A block holding an async placeholder waits: its hash needs the token's id.
        num_full = min(request.num_computed_tokens, request.num_known_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        request.update_block_hashes(self.block_size)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def quarantine(self, request_id: str) -> str:
        """Move a request's blocks aside, still referenced, under a new key."""
        key = f"quarantine-{request_id}-{next(self._quarantine_ids)}"
        self.quarantined[key] = self.req_to_blocks.pop(request_id, [])
        self.req_to_block_ids.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        return key

    def release_quarantine(self, key: str) -> None:
        self.pool.free_blocks(reversed(self.quarantined.pop(key)))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
