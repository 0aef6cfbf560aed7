"""Transfer descriptors and the KV-block -> descriptor mapping (with coalescing).

A descriptor names a byte range inside one registered memory region: `(region, offset_bytes,
length_bytes)`. A transfer is two equally long lists, local and remote, paired by position.

Why coalescing matters: every descriptor is one RMA operation, and each operation costs ~9 us
of host time from Python (FACTS.md). Blocks with consecutive ids are adjacent in memory, so a
run of consecutive ids becomes one descriptor. Paired lists are coalesced jointly: a pair of
runs grows only while *both* the local and the remote id advance by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Desc(NamedTuple):
    """A byte range in registered region `region` (0-based, registration order)."""

    region: int
    offset_bytes: int
    length_bytes: int


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs `(local_start, remote_start, num_blocks)` of jointly consecutive block ids.

    Pairs are sorted by local id first (transfer order does not matter: a handle completes only
    when all of its operations have), so `[3, 1, 2] -> [9, 7, 8]` is a single run.
    """
    if len(local_ids) != len(remote_ids):
        raise ValueError(
            f"local and remote block lists differ in length: {len(local_ids)} vs {len(remote_ids)}"
        )
    runs: list[tuple[int, int, int]] = []
    for local_id, remote_id in sorted(zip(local_ids, remote_ids)):
        if local_id < 0 or remote_id < 0:
            raise ValueError(f"negative block id in pair ({local_id}, {remote_id})")
        if runs:
            l0, r0, n = runs[-1]
            if local_id == l0 + n and remote_id == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((local_id, remote_id, 1))
    return runs


def paired_block_descs(
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    block_bytes: Sequence[int],
    regions: Sequence[int] | None = None,
) -> tuple[list[Desc], list[Desc]]:
    """Coalesced local/remote descriptors moving blocks `local_ids[i] <-> remote_ids[i]`.

    `block_bytes[r]` is the block stride of region r (block b starts at `b * block_bytes[r]`
    and is `block_bytes[r]` long); both sides share the geometry (same model, same block size).
    `regions` selects the regions to emit (default: all), e.g. one layer as soon as it is done.
    Output is grouped by region, then by run.
    """
    if regions is None:
        regions = range(len(block_bytes))
    runs = block_runs(local_ids, remote_ids)
    local: list[Desc] = []
    remote: list[Desc] = []
    for r in regions:
        stride = block_bytes[r]
        if stride <= 0:
            raise ValueError(f"block_bytes[{r}] must be positive, got {stride}")
        for local_start, remote_start, n in runs:
            local.append(Desc(r, local_start * stride, n * stride))
            remote.append(Desc(r, remote_start * stride, n * stride))
    return local, remote


def block_descs(
    block_ids: Sequence[int], block_bytes: Sequence[int], regions: Sequence[int] | None = None
) -> list[Desc]:
    """Coalesced descriptors for `block_ids` on one side (see `paired_block_descs`)."""
    return paired_block_descs(block_ids, block_ids, block_bytes, regions)[0]
