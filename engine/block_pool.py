"""The pool of KV-cache blocks, with prefix caching.

Invariants:
- Block 0 is the null block: never handed out, used as padding target (CUDA graphs, masked
  slots). The idle pool therefore has `num_blocks - 1` free blocks.
- A block is in the free queue iff its ref count is 0. A free block may still hold a hash: its
  KV stays reusable until the block is handed out again (evicted), in LRU order.
- `cached` maps a block hash to the one block holding it. A hash is removed (and a `removed`
  event emitted) exactly when its block is evicted or the cache is cleared.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.block_hash import BlockHash


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


@dataclass(frozen=True)
class KVCacheEvent:
    """`kind` is 'stored', 'removed' or 'cleared'; the publisher adds the instance epoch."""

    kind: str
    block_hashes: tuple[BlockHash, ...] = ()


@dataclass
class BlockPoolStats:
    num_evictions: int = 0
    events: list[KVCacheEvent] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_events: bool = True):
        assert num_blocks >= 2, "need the null block and at least one usable block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        # Free queue in eviction order: head = least recently freed.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.stats = BlockPoolStats()
        # The event being gathered (`_emit`): its kind and hashes, not yet in stats.events.
        self._run_kind: str | None = None
        self._run_hashes: list[BlockHash] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (next evicted first)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    # ---- allocation ----------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (they may be free)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the queue tail in order.

        Callers pass a request's blocks in reverse so its tail blocks (least likely to be
        shared) are evicted before its head blocks.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            assert block is not self.null_block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # ---- prefix cache --------------------------------------------------------------------
    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record that `block` holds the KV of the chain ending in `block_hash`."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            # Another block already holds this content (computed twice concurrently); keep the
            # first as the canonical copy, this one stays anonymous.
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self._emit("stored", block_hash)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached[block.block_hash]
        self._emit("removed", block.block_hash)
        block.block_hash = None
        self.stats.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks[1:]:
            block.block_hash = None
        self.cached.clear()
        if self.enable_events:
            self._close_run()
            self.stats.events.append(KVCacheEvent("cleared"))
        return True

    def _emit(self, kind: str, block_hash: BlockHash) -> None:
        """Consecutive events of one kind make one event: its hashes gather in a list, closed
        into the event's tuple when the kind changes or the events are taken (growing the
        tuple by one per block was quadratic: 4 s of an 8B offline job's 24 s on the H200)."""
        if not self.enable_events:
            return
        if kind != self._run_kind:
            self._close_run()
            self._run_kind = kind
        self._run_hashes.append(block_hash)

    def _close_run(self) -> None:
        if self._run_kind is not None:
            self.stats.events.append(KVCacheEvent(self._run_kind, tuple(self._run_hashes)))
            self._run_kind, self._run_hashes = None, []

    def take_events(self) -> list[KVCacheEvent]:
        self._close_run()
        events, self.stats.events = self.stats.events, []
        return events
