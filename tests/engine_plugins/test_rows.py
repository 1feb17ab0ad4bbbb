"""Folding of token-only rows and coercion of raw rows into valid schema columns."""

from __future__ import annotations

import math

from kvscope.engine_plugins import schema
from kvscope.engine_plugins._rows import ColumnBuilder, StepFolder


def step(ts: float, n: int, *, running: int = 4, gen: int = 2, prompt: int = 0) -> tuple:
    return (ts, n, running, 1, 0, 0.5, 10, 5, 0, prompt, gen, None)


def tokens(ts: float, n: int, *, gen: int = 3, prompt: int = 7, pre: int = 1) -> tuple:
    return (ts, n, None, None, None, None, 0, 0, pre, prompt, gen, None)


def test_token_only_rows_fold_into_the_next_step_row() -> None:
    f = StepFolder()
    assert f.feed(step(10.0, 1)) == [step(10.0, 1)]
    assert f.feed(tokens(10.1, 2)) == []
    assert f.feed(tokens(10.2, 3)) == []
    assert f.carry_rows == 2
    (row,) = f.feed(step(10.3, 4, gen=2))
    assert (row[0], row[1], row[2]) == (10.3, 4, 4)  # the step's own ts, step, gauges
    assert (row[8], row[9], row[10]) == (2, 14, 2 + 6)  # preemptions, prompt, generation
    assert (f.merged_rows, f.carry_rows) == (2, 0)


def test_carry_becomes_a_row_with_the_last_gauges_when_its_second_ends() -> None:
    f = StepFolder()
    f.feed(step(10.0, 1, running=9))
    f.feed(tokens(20.0, 2, gen=5))
    f.feed(tokens(20.5, 3, gen=5))
    assert f.take_carry(20.99, final=False) is None
    row = f.take_carry(21.0, final=False)
    assert row is not None
    assert (row[0], row[1], row[2], row[10], row[11]) == (20.5, 3, 9, 10, None)
    assert (f.merged_rows, f.carry_rows) == (1, 0)
    assert f.take_carry(99.0, final=True) is None


def test_carried_tokens_stay_in_their_second() -> None:
    # An API server process that gets no scheduler stats for a while: its tokens must
    # land in the seconds they were made in, not in the second of its next step row.
    f = StepFolder()
    sent = f.feed(step(10.0, 1, running=9))
    assert f.feed(tokens(10.6, 2, gen=4)) == []
    (carried,) = f.feed(tokens(11.2, 3, gen=6))
    assert (carried[0], carried[2], carried[10]) == (10.6, 9, 4)
    sent.append(carried)
    later, own = f.feed(step(12.1, 4, running=7, gen=2))
    assert (later[0], later[10]) == (11.2, 6)
    assert own == step(12.1, 4, running=7, gen=2)  # nothing of an earlier second in it
    sent += [later, own]
    assert f.take_carry(99.0, final=True) is None
    assert sum(r[10] for r in sent) == 2 + 4 + 6 + 2  # vLLM's total, every token once


def test_final_flush_emits_carry_even_without_gauges() -> None:
    f = StepFolder()
    f.feed(tokens(5.0, 1, gen=4))
    row = f.take_carry(5.0, final=True)
    assert row is not None and row[2:6] == (0, 0, 0, 0.0) and row[10] == 4


def _batch(steps: dict, requests: dict) -> dict:
    return {
        "schema_version": schema.SCHEMA_VERSION,
        "engine_id": "e",
        "boot_id": "b",
        "seq": 0,
        "sent_unix_s": 1.0,
        "hello": None,
        "steps": steps,
        "requests": requests,
        "exporter": {},
    }


def test_columns_coerce_bad_values_into_a_valid_batch() -> None:
    cb = ColumnBuilder()
    rows = [
        (1.5, 1, 3, 0, 0, 0.5, 10, 4, 0, 8, 2, 12.0),
        (2.0, 2, "4", -1, True, 1.7, math.nan, None, 2.0, 3.4, "x", math.inf),
    ]
    cols = cb.steps(rows, num_gpu_blocks=48)
    schema.validate_batch(_batch(cols, {}))
    assert cols["kv_blocks_used"] == [24, 48]
    assert cols["kv_usage_ratio"] == [0.5, 1.0]
    assert cols["batch_size"] == [3, 4]
    assert cols["waiting"] == [0, 0]
    assert cols["iteration_s"] == [0.012, None]
    assert cols["generation_tokens"] == [2, 0]
    assert cb.invalid_values == 5  # -1, nan, None, "x", inf
    reqs = cb.requests([(1.0, math.nan, 0.1, 0.2, 0.3, None, 5, 2, 0, 0, "LENGTH")])
    schema.validate_batch(_batch({}, reqs))
    assert reqs["finish_reason"] == ["length"] and reqs["e2e_s"] == [0.0]


def test_unknown_num_gpu_blocks_gives_zero_blocks() -> None:
    cols = ColumnBuilder().steps([(1.0, 1, 3, 0, 0, 0.5, 0, 0, 0, 0, 0, None)], None)
    assert cols["kv_blocks_used"] == [0]
