"""SQL fragments shared by the store's statements."""

from __future__ import annotations

INT64_MAX = 2**63 - 1


def saturated(expr: str) -> str:
    """``expr`` (an integer sum, HUGEINT in DuckDB) as a BIGINT held to +-(2^63-1) instead
    of failing on overflow: a sum past the range reads as the range's end. The wire
    schema's bounds keep real sums far below it (see docs/reliability.md)."""
    return f"CAST(greatest(least({expr}, {INT64_MAX}), -{INT64_MAX}) AS BIGINT)"


def saturated_add(a: str, b: str) -> str:
    """``a + b`` of two BIGINT columns, held to the BIGINT range (see :func:`saturated`)."""
    return saturated(f"CAST({a} AS HUGEINT) + {b}")
