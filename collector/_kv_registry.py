"""Prefix-block accounting across the replicas of a pool, from their KV-cache events.

vLLM seeds its block hashes per process, so they cannot be compared across engines.
Every stored block therefore gets a **canonical content id**: a 63-bit BLAKE2b digest
of its parent's id, its KV-cache group, LoRA, extra keys and token ids, so (as vLLM's
own hash) it stands for the whole prefix. An engine maps ``local hash -> canonical id``
for the blocks it holds (:class:`EngineBlocks`); a pool maps ``canonical id -> engines
holding it`` as a bit mask over its members' slots (:class:`Pool`).

Counted per event batch into a row of :data:`ROW_FIELDS`: ``stored_blocks`` (a store of
a hash already held is a reported hit, not counted), ``dup_blocks`` (another engine of
the pool held the content then), ``reseen_blocks`` (the pool stored it before, within
its seen memory), ``orphan_blocks`` (unknown parent: they chain among themselves but
never match another engine, nor count as dup or reseen), ``removed_blocks``,
``cleared_events``, ``missed_batches`` (sequence gaps), and at the batch's end
``held_blocks``, ``held_shared_blocks`` and the largest ``block_size``.

A sequence number going back means the publisher restarted: the engine's blocks are
forgotten. Only the GPU tier is tracked (others are counted as ignored). Memory is
bounded: a pool's seen memory keeps at most ``seen_capacity`` ids in two generations
(the old one dropped whole when the young one fills, counted), an engine at most
``max_blocks`` blocks (more are counted as untracked; their children become orphans).

Details: docs/fleet.md#kv-cache-events-prefix-duplication-across-replicas
"""

from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import Any

from kvscope.collector._kv_wire import BlockRemoved, BlockStored, Message
from kvscope.collector.tables import KV_EVENT_FIELDS

ROW_FIELDS: tuple[str, ...] = tuple(c for c, _ in KV_EVENT_FIELDS)
(
    N_BATCHES,
    STORED,
    DUP,
    RESEEN,
    ORPHAN,
    REMOVED,
    CLEARED,
    MISSED,
    HELD,
    HELD_SHARED,
    BLOCK_SIZE,
) = range(len(ROW_FIELDS))
assert ROW_FIELDS[BLOCK_SIZE] == "block_size" and ROW_FIELDS[STORED] == "stored_blocks"

ROOT = 0
"""Canonical id standing for "no parent" (the start of a prompt)."""
_GPU_MEDIA = (None, "GPU")


def new_row() -> list[int]:
    """A row of zero counters, in :data:`ROW_FIELDS` order."""
    return [0] * len(ROW_FIELDS)


def _digest(h: Any) -> int:
    return int.from_bytes(h.digest(), "big") >> 1


def content_id(
    parent: int,
    group: int,
    lora: object,
    extra: object,
    tokens: list[int],
    index: int | None = None,
) -> int:
    """Canonical id of a block: its parent's id and its own content (see module doc)."""
    h = blake2b(parent.to_bytes(8, "big"), digest_size=8)
    h.update(f"{group}|{lora!r}|{extra!r}|{index}|".encode())
    h.update(array("q", tokens).tobytes())
    return _digest(h)


def local_id(marker: str, group: int, local_hash: object) -> int:
    """Engine-local id standing in for a parent the engine's map does not know."""
    return _digest(blake2b(f"{marker}|{group}|{local_hash!r}".encode(), digest_size=8))


class SeenMemory:
    """A bounded set of ids with approximate least-recently-seen eviction."""

    def __init__(self, capacity: int) -> None:
        self._half = max(1, capacity // 2)
        self._young: set[int] = set()
        self._old: set[int] = set()
        self.dropped = 0
        """Ids forgotten to stay within the capacity."""

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def check_and_add(self, cid: int) -> bool:
        """Remember ``cid``; return whether it was remembered already."""
        if cid in self._young:
            return True
        seen = cid in self._old
        if seen:
            self._old.discard(cid)
        self._young.add(cid)
        if len(self._young) >= self._half:
            self.dropped += len(self._old)
            self._old, self._young = self._young, set()
        return seen


class Pool:
    """The engines of one pool and which of them holds each canonical block."""

    def __init__(self, name: str, seen_capacity: int) -> None:
        self.name = name
        self.holders: dict[int, int] = {}
        """Canonical id -> bit mask of the member slots holding it."""
        self.seen = SeenMemory(seen_capacity)
        self.members: dict[int, EngineBlocks] = {}

    @property
    def distinct_blocks(self) -> int:
        """Distinct canonical blocks held by the pool's engines."""
        return len(self.holders)

    def _join(self, eng: EngineBlocks) -> int:
        slot = 0
        while slot in self.members:
            slot += 1
        self.members[slot] = eng
        return slot

    def _member(self, mask: int) -> EngineBlocks:
        """The one member whose bit is set in ``mask``."""
        return self.members[mask.bit_length() - 1]


class EngineBlocks:
    """The blocks one engine (one boot, one subscription) holds, as its pool sees them."""

    def __init__(self, engine_id: str, marker: str, pool: Pool, max_blocks: int) -> None:
        self.engine_id = engine_id
        self.marker = marker
        self.pool = pool
        self.max_blocks = max_blocks
        self.slot = pool._join(self)
        self.bit = 1 << self.slot
        self.blocks: dict[Any, int] = {}
        """Local hash (``(group, hash)`` for groups other than 0) -> canonical id."""
        self._refs: dict[int, int] = {}
        """Canonical ids held under more than one local hash -> how many."""
        self.shared = 0
        """Distinct held canonical ids that another member holds too."""
        self.last_seq: int | None = None
        self.untracked = 0
        """Stored blocks not tracked because ``max_blocks`` was reached."""
        self.ignored = 0
        """Blocks of other tiers than the GPU (CPU, storage offloading)."""
        self.bad_events = 0
        """Events that could not be read (e.g. token ids that are not integers)."""
        self.restarts = 0
        """Times the publisher's sequence went back (its blocks were forgotten)."""

    # -- one message -----------------------------------------------------------------

    def apply(self, msg: Message, row: list[int]) -> None:
        """Account one decoded message into ``row`` (a :func:`new_row`)."""
        last = self.last_seq
        if last is not None:
            if msg.seq > last + 1:
                row[MISSED] += msg.seq - last - 1
            elif msg.seq <= last:
                self.restarts += 1
                self.clear()
        self.last_seq = msg.seq
        row[N_BATCHES] += 1
        for ev in msg.events:
            try:
                if isinstance(ev, BlockStored):
                    self._stored(ev, row)
                elif isinstance(ev, BlockRemoved):
                    self._removed(ev, row)
                else:
                    self.clear()
                    row[CLEARED] += 1
            except (TypeError, ValueError, OverflowError):
                self.bad_events += 1
        self.bad_events += msg.unknown_events
        row[HELD] = len(self.blocks)
        row[HELD_SHARED] = self.shared

    def _stored(self, ev: BlockStored, row: list[int]) -> None:
        hashes = ev.block_hashes
        if ev.medium not in _GPU_MEDIA:
            self.ignored += len(hashes)
            return
        g = ev.group_idx or 0
        blocks = self.blocks
        orphan = False
        if ev.parent_block_hash is None:
            pcid = ROOT
        else:
            known = blocks.get(ev.parent_block_hash if g == 0 else (g, ev.parent_block_hash))
            if known is None:
                orphan = True
                pcid = local_id(self.marker, g, ev.parent_block_hash)
            else:
                pcid = known
        bs = ev.block_size
        toks = ev.token_ids
        aligned = bs > 0 and len(toks) == len(hashes) * bs
        lora = ev.lora_name if ev.lora_name is not None else ev.lora_id
        extra = ev.extra_keys or ()
        pool = self.pool
        others = ~self.bit
        if bs > row[BLOCK_SIZE]:
            row[BLOCK_SIZE] = bs
        for i, h in enumerate(hashes):
            key = h if g == 0 else (g, h)
            have = blocks.get(key)
            if have is not None:  # a prefix-cache hit reported again, not a new store
                pcid = have
                continue
            cid = content_id(
                pcid,
                g,
                lora,
                extra[i] if i < len(extra) else None,
                toks[i * bs : (i + 1) * bs] if aligned else toks,
                None if aligned else i,
            )
            row[STORED] += 1
            if orphan:
                row[ORPHAN] += 1
            else:
                if pool.holders.get(cid, 0) & others:
                    row[DUP] += 1
                if pool.seen.check_and_add(cid):
                    row[RESEEN] += 1
            self._hold(key, cid)
            pcid = cid

    def _removed(self, ev: BlockRemoved, row: list[int]) -> None:
        if ev.medium not in _GPU_MEDIA:
            self.ignored += len(ev.block_hashes)
            return
        g = ev.group_idx or 0
        row[REMOVED] += len(ev.block_hashes)
        for h in ev.block_hashes:
            self._release(h if g == 0 else (g, h))

    # -- holding -----------------------------------------------------------------------

    def _hold(self, key: Any, cid: int) -> None:
        if len(self.blocks) >= self.max_blocks:
            self.untracked += 1
            return
        self.blocks[key] = cid
        holders = self.pool.holders
        mask = holders.get(cid, 0)
        if mask & self.bit:
            self._refs[cid] = self._refs.get(cid, 1) + 1
            return
        if mask:
            self.shared += 1
            if mask.bit_count() == 1:
                self.pool._member(mask).shared += 1
        holders[cid] = mask | self.bit

    def _release(self, key: Any) -> None:
        cid = self.blocks.pop(key, None)
        if cid is None:
            return
        n = self._refs.get(cid)
        if n is not None:
            if n <= 2:
                del self._refs[cid]
            else:
                self._refs[cid] = n - 1
            return
        holders = self.pool.holders
        rest = holders.get(cid, 0) & ~self.bit
        if not rest:
            holders.pop(cid, None)
            return
        holders[cid] = rest
        self.shared -= 1
        if rest.bit_count() == 1:
            self.pool._member(rest).shared -= 1

    def clear(self) -> None:
        """Forget every block the engine holds (the pool's registry follows)."""
        for key in list(self.blocks):
            self._release(key)
        self._refs.clear()

    def leave(self) -> None:
        """Forget the blocks and give up the pool slot (unsubscribed, restarted, moved)."""
        self.clear()
        if self.pool.members.get(self.slot) is self:
            del self.pool.members[self.slot]
