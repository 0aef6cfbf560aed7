"""Block pool and KV-cache manager on tiny specs: exact ids, ref counts, LRU eviction order."""

from __future__ import annotations

from engine.block_hash import hash_block_tokens
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def schedule(kv: KVCacheManager, req: Request) -> int:
    """Allocate like the scheduler does for a waiting request; mark it all computed."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return num_hit


def test_block_zero_is_null_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)


def test_allocation_ids_refcounts_and_sharing():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert schedule(kv, a) == 0
    assert kv.get_block_ids("a") == [1, 2, 3]
    b = make_request("b", list(range(8)) + [99, 98, 97])  # shares a's 2 full blocks
    assert schedule(kv, b) == 8
    assert kv.get_block_ids("b") == [1, 2, 4]
    pool = kv.pool
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    kv.free(b)
    assert pool.num_free_blocks == 10  # idle again: nothing leaked


def test_lru_eviction_order():
    kv = KVCacheManager(num_blocks=7, block_size=BS)  # 6 usable
    a = make_request("a", list(range(0, 8)))  # blocks 1,2 (block 2 full but last token recomputed)
    b = make_request("b", list(range(100, 108)))  # blocks 3,4
    schedule(kv, a)
    schedule(kv, b)
    kv.free(a)  # a's blocks join the tail, reversed: 2 then 1
    kv.free(b)  # then 4, 3
    # Free queue: never-used 5, 6 first, then a's tail-first, then b's.
    assert kv.pool.free_block_ids() == [5, 6, 2, 1, 4, 3]
    cached_before = set(kv.pool.cached)
    assert len(cached_before) == 4
    c = make_request("c", list(range(200, 216)))  # needs 4 blocks: takes 5, 6, 2, 1
    schedule(kv, c)
    assert kv.get_block_ids("c") == [5, 6, 2, 1]
    events = kv.pool.take_events()
    removed = [h for e in events if e.kind == "removed" for h in e.block_hashes]
    a_hashes = hash_block_tokens(list(range(0, 8)), BS)
    assert removed == [a_hashes[1], a_hashes[0]]  # a evicted, tail block first
    # b's prefix is still cached, a's is gone.
    assert kv.get_computed_blocks(make_request("b2", list(range(100, 109))))[1] == 8
    assert kv.get_computed_blocks(make_request("a2", list(range(0, 9))))[1] == 0


def test_hit_on_free_block_counts_against_free_pool():
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = make_request("a", list(range(9)))
    schedule(kv, a)
    kv.free(a)
    b = make_request("b", list(range(8)) + [50] * 5)  # 2 hits (free) + needs 2 new blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert not kv.allocate_slots(b, b.num_tokens - n, hits)  # 2 + 2 > 3
    assert kv.pool.num_free_blocks == 3 and "b" not in kv.req_to_blocks


def test_cache_salt_isolates_prefixes():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    schedule(kv, make_request("a", list(range(12)), salt="tenant-a"))
    assert schedule(kv, make_request("b", list(range(13)), salt="tenant-b")) == 0
    assert schedule(kv, make_request("c", list(range(13)), salt="tenant-a")) == 12
    assert schedule(kv, make_request("d", list(range(13)))) == 0
    assert hash_block_tokens(range(8), BS, "x") != hash_block_tokens(range(8), BS, "y")
    assert hash_block_tokens(range(8), BS)[1] == hash_block_tokens(range(8), BS, None, ())[1]


def test_a_block_hits_only_after_the_same_blocks_before_it():
    """Block i's hash chains over blocks 0..i-1: the same tokens after a different prefix are a
    different block (their KV attended to different tokens), so `[a, c, b]` must not reuse the
    `c` computed for `[x, c]`, although `a` and `c` are each cached."""
    a, c, b, x, y = ([v] * BS for v in (1, 2, 3, 4, 5))
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    schedule(kv, make_request("ay", a + y + [0]))  # caches a, then y after a
    schedule(kv, make_request("xc", x + c + [0]))  # caches x, then c after x
    assert hash_block_tokens(a + c, BS)[1] != hash_block_tokens(x + c, BS)[1]
    assert len(kv.pool.cached) == 4
    queries, hits = kv.prefix_stats.queries, kv.prefix_stats.hits
    assert schedule(kv, make_request("acb", a + c + b + [0])) == BS  # a only
    assert (kv.prefix_stats.queries - queries, kv.prefix_stats.hits - hits) == (3 * BS + 1, BS)
    # Its block 1 is new, not xc's block 1; it caches its own c and b after a.
    assert kv.get_block_ids("acb")[0] == kv.get_block_ids("ay")[0]
    assert kv.get_block_ids("acb")[1] not in kv.get_block_ids("xc")
    assert len(kv.pool.cached) == 6
    # The same tokens after the same prefix do hit, every block.
    assert schedule(kv, make_request("acb2", a + c + b + [9])) == 3 * BS


def test_events_and_reset():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(9)))
    schedule(kv, a)
    events = kv.pool.take_events()
    assert [e.kind for e in events] == ["stored"]
    assert list(events[0].block_hashes) == hash_block_tokens(list(range(9)), BS)
    assert not kv.reset_prefix_cache()  # refused while blocks are in use
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert [e.kind for e in kv.pool.take_events()] == ["cleared"]
    assert not kv.pool.cached


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    schedule(kv, make_request("a", list(range(9))))
    assert schedule(kv, make_request("b", list(range(9)))) == 0


def test_events_in_order_across_kinds():
    """Consecutive events of one kind come out as one event, kinds in the order they happened:
    a's blocks stored, then evicted for b's, then b's stored; a reset after a store closes
    the stored run first."""
    pool = BlockPool(4)  # 3 usable blocks
    blocks = pool.get_new_blocks(3)
    hashes_a = hash_block_tokens(list(range(12)), BS)
    for block, h in zip(blocks, hashes_a):
        pool.cache_block(block, h)
    pool.free_blocks(reversed(blocks))
    blocks = pool.get_new_blocks(2)  # evicts two of a's (its tail first)
    hashes_b = hash_block_tokens(list(range(100, 108)), BS)
    for block, h in zip(blocks, hashes_b):
        pool.cache_block(block, h)
    events = pool.take_events()
    assert [e.kind for e in events] == ["stored", "removed", "stored"]
    assert list(events[0].block_hashes) == hashes_a
    assert set(events[1].block_hashes) == set(hashes_a[1:])
    assert list(events[2].block_hashes) == hashes_b
    assert pool.take_events() == []


def test_reset_after_a_store_keeps_their_order():
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    h = hash_block_tokens([1, 2, 3, 4], BS)[0]
    pool.cache_block(block, h)
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    events = pool.take_events()
    assert [(e.kind, e.block_hashes) for e in events] == [("stored", (h,)), ("cleared", ())]
