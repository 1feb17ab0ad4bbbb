"""Small helpers building pandas columns that DuckDB reads with the right types."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from kvscope.engine_plugins.schema import BOOL, FLOAT, INT


def obj_array(values: list[Any]) -> np.ndarray:
    """A 1-d object array (strings or None) without numpy guessing a shape or dtype."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def typed_column(kind: str, values: list[Any]) -> Any:
    """A column for a wire-schema kind that keeps NULLs and integer types."""
    if kind == INT:
        return pd.array(values, dtype="Int64")
    if kind == FLOAT:
        return np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    if kind == BOOL:
        return pd.array(values, dtype="boolean")
    return obj_array(values)
