"""Prefix-block accounting: canonical ids, duplicates against a brute-force model, bounds."""

from __future__ import annotations

import random

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared as VAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
from vllm.distributed.kv_events import BlockStored as VBlockStored
from vllm.distributed.kv_events import KVEventBatch

from kvscope.collector._kv_registry import (
    BLOCK_SIZE,
    CLEARED,
    DUP,
    HELD,
    HELD_SHARED,
    MISSED,
    N_BATCHES,
    ORPHAN,
    REMOVED,
    RESEEN,
    STORED,
    EngineBlocks,
    Pool,
    SeenMemory,
    content_id,
    new_row,
)
from kvscope.collector._kv_wire import Message, WireError, decode

ENC = msgspec.msgpack.Encoder()


def _msg(seq: int, events: list[object], ts: float = 1_700_000_000.5) -> Message:
    """Encode real vLLM events as vLLM's publisher does and decode them as the collector."""
    return decode([b"kv", seq.to_bytes(8, "big"), ENC.encode(KVEventBatch(ts=ts, events=events))])


def stored(
    hashes: list[int | bytes],
    parent: int | bytes | None,
    tokens: list[int],
    bs: int = 4,
    **kw: object,
) -> VBlockStored:
    kw.setdefault("lora_id", None)
    kw.setdefault("medium", "GPU")
    kw.setdefault("lora_name", None)
    return VBlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs, **kw
    )


def removed(hashes: list[int | bytes]) -> VBlockRemoved:
    return VBlockRemoved(block_hashes=hashes, medium="GPU")


def _engine(pool: Pool, name: str) -> EngineBlocks:
    return EngineBlocks(name, f"{name}|boot", pool, max_blocks=1_000_000)


def test_same_content_same_id_whatever_the_local_hashes() -> None:
    pool = Pool("p", 1000)
    a, b = _engine(pool, "a"), _engine(pool, "b")
    ra, rb = new_row(), new_row()
    a.apply(_msg(0, [stored([101, 102], None, list(range(8)))]), ra)
    # b: the same two blocks under other hashes (bytes, as sha256 gives), in two events.
    b.apply(
        _msg(
            0,
            [
                stored([b"\x07" * 32], None, list(range(4))),
                stored([b"\x08" * 32], b"\x07" * 32, list(range(4, 8))),
            ],
        ),
        rb,
    )
    assert set(a.blocks.values()) == set(b.blocks.values())
    assert (ra[STORED], ra[DUP], ra[RESEEN]) == (2, 0, 0)
    assert (rb[STORED], rb[DUP], rb[RESEEN], rb[HELD], rb[HELD_SHARED]) == (2, 2, 2, 2, 2)
    assert a.shared == 2 and pool.distinct_blocks == 2
    assert rb[BLOCK_SIZE] == 4 and rb[N_BATCHES] == 1


def test_content_id_depends_on_prefix_lora_extra_keys_and_group() -> None:
    base = content_id(0, 0, None, None, [1, 2, 3, 4])
    assert content_id(0, 0, None, None, [1, 2, 3, 4]) == base
    others = {
        content_id(7, 0, None, None, [1, 2, 3, 4]),
        content_id(0, 1, None, None, [1, 2, 3, 4]),
        content_id(0, 0, "adapter", None, [1, 2, 3, 4]),
        content_id(0, 0, None, ["salt"], [1, 2, 3, 4]),
        content_id(0, 0, None, None, [1, 2, 3, 5]),
    }
    assert base not in others and len(others) == 5
    assert 0 < base < 2**63


def test_lora_separates_identical_tokens() -> None:
    pool = Pool("p", 1000)
    a, b = _engine(pool, "a"), _engine(pool, "b")
    a.apply(_msg(0, [stored([1], None, [1, 2, 3, 4], lora_id=1, lora_name="x")]), new_row())
    rb = new_row()
    b.apply(_msg(0, [stored([2], None, [1, 2, 3, 4])]), rb)
    assert rb[DUP] == 0 and pool.distinct_blocks == 2


def test_orphans_chain_but_never_duplicate() -> None:
    pool = Pool("p", 1000)
    a, b = _engine(pool, "a"), _engine(pool, "b")
    a.apply(_msg(0, [stored([1, 2], None, list(range(8)))]), new_row())
    rb = new_row()
    # b joined mid-stream: its parent 55 is unknown; the tokens equal a's second block.
    b.apply(_msg(0, [stored([9], 55, list(range(4, 8))), stored([10], 9, [40, 41, 42, 43])]), rb)
    assert (rb[STORED], rb[ORPHAN], rb[DUP], rb[RESEEN]) == (2, 1, 0, 0)
    assert b.blocks[10] != a.blocks[2]
    assert pool.distinct_blocks == 4 and b.shared == 0


def test_removal_clear_and_rereported_blocks() -> None:
    pool = Pool("p", 1000)
    a, b = _engine(pool, "a"), _engine(pool, "b")
    a.apply(_msg(0, [stored([1, 2, 3], None, list(range(12)))]), new_row())
    b.apply(_msg(0, [stored([7, 8], None, list(range(8)))]), new_row())
    assert (a.shared, b.shared) == (2, 2)
    r = new_row()
    a.apply(_msg(1, [removed([2]), removed([999])]), r)  # 999 was never held
    assert (r[REMOVED], r[HELD], r[HELD_SHARED]) == (2, 2, 1)
    assert b.shared == 1
    # A prefix-cache hit reported again as BlockStored (kv_cache_report_mode="full").
    r = new_row()
    b.apply(_msg(1, [stored([7, 8], None, list(range(8)))]), r)
    assert (r[STORED], r[DUP], r[HELD]) == (0, 0, 2)
    r = new_row()
    b.apply(_msg(2, [VAllBlocksCleared()]), r)
    assert (r[CLEARED], r[HELD], r[HELD_SHARED]) == (1, 0, 0)
    assert a.shared == 0 and pool.distinct_blocks == 2


def test_sequence_gaps_and_publisher_restart() -> None:
    pool = Pool("p", 1000)
    a = _engine(pool, "a")
    r = new_row()
    a.apply(_msg(5, []), r)  # the first message seen: no gap to speak of
    a.apply(_msg(6, [stored([1], None, [1, 2, 3, 4])]), r)
    a.apply(_msg(10, []), r)
    assert (r[MISSED], r[N_BATCHES], r[HELD]) == (3, 3, 1)
    a.apply(_msg(0, []), r)  # the publisher started again: its old hashes mean nothing now
    assert (a.restarts, r[HELD], pool.distinct_blocks) == (1, 0, 0)


def test_other_tiers_ignored_and_bad_tokens_counted() -> None:
    pool = Pool("p", 1000)
    a = _engine(pool, "a")
    r = new_row()
    a.apply(
        _msg(
            0, [stored([1], None, [1, 2, 3, 4], medium="CPU"), stored([2], None, [2**63, 1, 1, 1])]
        ),
        r,
    )
    assert (r[STORED], a.ignored, a.bad_events, len(a.blocks)) == (0, 1, 1, 0)


def test_untracked_beyond_the_engine_cap() -> None:
    pool = Pool("p", 1000)
    a = EngineBlocks("a", "a|b", pool, max_blocks=2)
    r = new_row()
    a.apply(_msg(0, [stored([1, 2, 3], None, list(range(12)))]), r)
    assert (r[STORED], r[HELD], a.untracked) == (3, 2, 1)


def test_seen_memory_is_bounded_and_counts_what_it_forgets() -> None:
    seen = SeenMemory(100)
    assert not seen.check_and_add(1)
    assert seen.check_and_add(1)
    for i in range(2, 1000):
        seen.check_and_add(i)
        assert len(seen) <= 100
    assert seen.dropped + len(seen) == 999
    assert seen.check_and_add(999) and not seen.check_and_add(1)


def test_undecodable_messages_raise_wire_error() -> None:
    with pytest.raises(WireError):
        decode([b"kv", b"\x00" * 8])
    with pytest.raises(WireError):
        decode([b"kv", b"\x00" * 8, b"\xc1"])
    with pytest.raises(WireError):
        decode([b"kv", b"\x00" * 8, ENC.encode({"not": "a batch"})])


def test_unknown_event_types_are_skipped_and_counted() -> None:
    raw = msgspec.msgpack.decode(
        ENC.encode(KVEventBatch(ts=1.0, events=[stored([1], None, [1, 2, 3, 4])]))
    )
    raw[1].append({"type": "SomethingNew", "x": 1})
    msg = decode([b"", (3).to_bytes(8, "big"), ENC.encode(raw)])
    assert len(msg.events) == 1 and msg.unknown_events == 1 and msg.seq == 3


def test_random_operations_match_a_brute_force_model() -> None:
    """Many engines storing, evicting and clearing random prefix trees: every counter
    equals what a direct recomputation over the engines' contents gives."""
    rnd = random.Random(11)
    pool = Pool("p", 10_000_000)
    engines = [_engine(pool, f"e{i}") for i in range(4)]
    # The truth: each engine's blocks as token prefixes (tuples), local hash -> prefix.
    truth: list[dict[int, tuple[int, ...]]] = [{} for _ in engines]
    seen: set[tuple[int, ...]] = set()
    next_hash = [1000 * (i + 1) * 1_000_000 for i in range(len(engines))]
    bs = 2
    for step in range(3000):
        i = rnd.randrange(len(engines))
        eng, held = engines[i], truth[i]
        op = rnd.random()
        row = new_row()
        if op < 0.6:
            # Store 1-3 blocks continuing a held prefix (or from the root), tokens from a
            # small alphabet so that engines often build the same prefixes.
            parents = [(h, p) for h, p in held.items()]
            parent_hash, prefix = (
                rnd.choice(parents) if parents and rnd.random() < 0.7 else (None, ())
            )
            n = rnd.randint(1, 3)
            toks = [rnd.randrange(3) for _ in range(n * bs)]
            hashes, expect_stored, expect_dup, expect_reseen = [], 0, 0, 0
            for k in range(n):
                prefix = prefix + tuple(toks[k * bs : (k + 1) * bs])
                existing = [h for h, p in held.items() if p == prefix]
                if existing:
                    hashes.append(existing[0])
                    continue
                next_hash[i] += 1
                hashes.append(next_hash[i])
                expect_stored += 1
                expect_dup += any(prefix in t.values() for j, t in enumerate(truth) if j != i)
                expect_reseen += prefix in seen
                seen.add(prefix)
                held[next_hash[i]] = prefix
            eng.apply(_msg(step, [stored(hashes, parent_hash, toks, bs=bs)]), row)
            assert (row[STORED], row[DUP], row[RESEEN], row[ORPHAN]) == (
                expect_stored,
                expect_dup,
                expect_reseen,
                0,
            )
        elif op < 0.95 and held:
            h = rnd.choice(list(held))
            del held[h]
            eng.apply(_msg(step, [removed([h])]), row)
        else:
            held.clear()
            eng.apply(_msg(step, [VAllBlocksCleared()]), row)
        for j, e in enumerate(engines):
            mine = set(truth[j].values())
            others = set().union(*(set(t.values()) for k, t in enumerate(truth) if k != j))
            assert len(e.blocks) == len(truth[j])
            assert e.shared == len(mine & others), (step, j)
        assert pool.distinct_blocks == len(set().union(*(set(t.values()) for t in truth)))
        assert row[HELD] == len(held) and row[HELD_SHARED] == eng.shared
