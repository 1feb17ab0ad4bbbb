"""What parsing an ingest body may cost, known before it is parsed.

``json.loads`` builds a Python object for every value, so a small body of ``{},`` can
take gigabytes. :func:`parse_cost` counts the bytes that open objects and lists,
separate values and delimit strings (``bytes.count``, window by window, so a worker
thread lets the event loop run in between) and

* refuses a body that cannot be a batch: the wire schema is columnar (5 objects, one
  list a column, at most ``MAX_ROWS_PER_BATCH`` values a column), and a character in a
  string adds at most one to these counts;
* bounds the bytes the parsed objects take (:data:`COSTS`, CPython's 64-bit object sizes
  with the parser's list growth); the caller takes that from the request's
  :class:`~kvscope.collector._guards.Lease` before it parses.

The bound, checked against tracemalloc and RSS: docs/reliability.md#a-hostile-or-buggy-sender
"""

from __future__ import annotations

from kvscope.engine_plugins.schema import (
    ENVELOPE_KEYS,
    EXPORTER_FIELDS,
    HELLO_FIELDS,
    MAX_ID_CHARS,
    MAX_ROWS_PER_BATCH,
    REQUEST_FIELDS,
    STEP_FIELDS,
    STR,
    SchemaError,
)

__all__ = ["COSTS", "MAX_STRING_CHARS", "MAX_STRUCTURE", "TEXT_BYTES", "parse_cost"]

WINDOW_BYTES = 1024 * 1024
"""Bytes counted per call, so a thread counting a large body yields the GIL in between."""

TOKENS = (b"{", b"[", b",", b'"')

COSTS: dict[bytes, int] = {b"{": 208, b"[": 96, b",": 48, b'"': 40}
"""Bytes charged per counted byte: a dict with its first keys (184, its 16-byte GC header,
a slot), a list with its first slot (56 + 16 + 8), a value (a float 24 or an int 28-32
bytes, its 8-byte slot and the list's growth by an eighth), half a string's header (49-80
bytes for its two quotes)."""

TEXT_BYTES = {"ascii": 2, "escapes": 3, "wide": 12}
"""Bytes per body byte for text: ``json.loads`` decodes the whole body to a ``str`` (1),
copies the strings out of it (1) and, for strings with escapes, their pieces first (1);
with any character past ASCII or a ``\\u`` escape, each of those may take 4 bytes a
character (UCS-4). Covers the digits of large ints too."""

_COLUMNS = (*STEP_FIELDS, *REQUEST_FIELDS)
_KEYS = (*ENVELOPE_KEYS, *HELLO_FIELDS, *EXPORTER_FIELDS, *_COLUMNS)

_STRINGS = (
    len(_KEYS)
    + 2  # engine_id, boot_id
    + sum(f.kind == STR for f in HELLO_FIELDS)
    + MAX_ROWS_PER_BATCH * sum(f.kind == STR for f in _COLUMNS)
)

MAX_STRUCTURE: dict[bytes, int] = {
    b"{": 5,  # the batch, hello, steps, requests, exporter
    b"[": len(_COLUMNS),
    b",": len(_COLUMNS) * MAX_ROWS_PER_BATCH + len(_KEYS),
    b'"': 2 * _STRINGS,
}
"""The most of each byte a valid batch has outside its strings."""

MAX_STRING_CHARS = (
    2 * MAX_ID_CHARS
    + sum(f.max_chars for f in HELLO_FIELDS if f.kind == STR)
    + MAX_ROWS_PER_BATCH * sum(f.max_chars for f in _COLUMNS if f.kind == STR)
)
"""The most characters the strings of a valid batch have (each may be one counted byte)."""

_NAMES = {b"{": "objects", b"[": "lists", b",": "values", b'"': "quotes"}


def parse_cost(body: bytes) -> int:
    """The most bytes ``json.loads(body)`` allocates; raises :class:`SchemaError` if no
    valid batch has as many structural bytes as ``body``."""
    counts = dict.fromkeys(TOKENS, 0)
    text = "ascii"
    for start in range(0, len(body), WINDOW_BYTES):
        end = start + WINDOW_BYTES
        for tok in TOKENS:
            counts[tok] += body.count(tok, start, end)
        _check(counts)
        if text != "wide" and body.find(b"\\", start, end) >= 0:
            text = "wide" if body.find(b"\\u", start, end + 1) >= 0 else "escapes"
        if text != "wide" and not body[start:end].isascii():
            text = "wide"
    return len(body) * TEXT_BYTES[text] + sum(COSTS[t] * n for t, n in counts.items())


def _check(counts: dict[bytes, int]) -> None:
    excess = {t: n - MAX_STRUCTURE[t] for t, n in counts.items() if n > MAX_STRUCTURE[t]}
    if sum(excess.values()) > MAX_STRING_CHARS:
        tok = max(excess, key=excess.__getitem__)
        raise SchemaError(
            f"body: cannot be a batch: {counts[tok]:,} or more JSON {_NAMES[tok]} "
            f"({tok.decode()!r}) where a batch has at most {MAX_STRUCTURE[tok]:,} (more only "
            f"as characters of its strings, at most {MAX_STRING_CHARS:,} in all)"
        )
