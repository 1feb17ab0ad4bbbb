"""Decoding vLLM's KV-cache event messages (what ``ZmqEventPublisher`` sends).

One ZMQ message is three frames: ``[topic, seq, payload]``; ``seq`` is an 8-byte
big-endian counter per publisher (0, 1, 2, ...), ``payload`` the msgspec msgpack of a
``KVEventBatch``. The batch is an array ``[ts, events, data_parallel_rank]`` (``ts``
wall-clock seconds of the engine); each event is a map tagged by ``"type"``:

* ``BlockStored``: ``block_hashes`` (int or bytes each), ``parent_block_hash``,
  ``token_ids`` (the tokens of all the blocks, ``block_size`` each), ``block_size``,
  ``lora_id``, ``medium``, ``lora_name``, and optionally ``extra_keys`` (one entry per
  block), ``group_idx`` (KV-cache group) and more fields that are ignored here;
* ``BlockRemoved``: ``block_hashes``, ``medium``, optionally ``group_idx``;
* ``AllBlocksCleared``.

The structs below mirror vLLM 0.32's (``vllm/distributed/kv_events.py``) without
importing vLLM; unknown fields are ignored, missing optional ones take defaults. A
payload with an event type this module does not know is decoded generically and the
known events are kept (the others are counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgspec

BlockHash = Union[int, bytes]  # noqa: UP007 - msgspec needs a runtime Union here


class BlockStored(msgspec.Struct, tag=True, gc=False):
    """``n`` blocks stored (cached) by the engine, in prefix order."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    """Blocks evicted from the engine's prefix cache."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    """The engine dropped its whole prefix cache (e.g. ``reset_prefix_cache``)."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published batch: engine wall-clock ``ts`` and its events."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class WireError(ValueError):
    """A message that is not a KV-event batch."""


@dataclass
class Message:
    """One decoded message."""

    seq: int
    ts: float
    events: list[Event]
    unknown_events: int = 0
    """Events of a type not known here (skipped)."""


_BATCH = msgspec.msgpack.Decoder(EventBatch)
_GENERIC = msgspec.msgpack.Decoder()


def decode(frames: list[bytes]) -> Message:
    """Decode the frames of one message; raise :class:`WireError` if it is not one."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise WireError(f"expected [topic, 8-byte seq, payload], got {len(frames)} frame(s)")
    seq = int.from_bytes(frames[1], "big")
    try:
        b = _BATCH.decode(frames[2])
        return Message(seq, b.ts, b.events)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as exc:
        raise WireError(f"payload is not msgpack: {exc}") from None
    return _decode_leniently(seq, frames[2])


def _decode_leniently(seq: int, payload: bytes) -> Message:
    try:
        raw = _GENERIC.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"payload is not msgpack: {exc}") from None
    if (
        not isinstance(raw, list)
        or len(raw) < 2
        or not isinstance(raw[1], list)
        or isinstance(raw[0], bool)
        or not isinstance(raw[0], (int, float))
    ):
        raise WireError("payload is not a [ts, events, ...] batch")
    events: list[Event] = []
    unknown = 0
    for ev in raw[1]:
        try:
            events.append(msgspec.convert(ev, Event))
        except msgspec.ValidationError:
            unknown += 1
    return Message(seq, float(raw[0]), events, unknown)
