"""The wire schema: what validate_batch accepts and what it rejects, by name."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from kvscope.engine_plugins import schema


def make_batch(n_steps: int = 3, n_requests: int = 1) -> dict[str, Any]:
    steps = {f.name: [] for f in schema.STEP_FIELDS}
    for i in range(n_steps):
        row = {
            "ts_unix_s": 1_700_000_000.0 + i * 0.01,
            "step": i,
            "batch_size": 4,
            "waiting": 1,
            "deferred": 0,
            "kv_usage_ratio": 0.5,
            "kv_blocks_used": 24,
            "prefix_queries": 10,
            "prefix_hits": 5,
            "preemptions": 0,
            "prompt_tokens": 10,
            "generation_tokens": 4,
            "iteration_s": None,
        }
        for k, v in row.items():
            steps[k].append(v)
    reqs = {f.name: [] for f in schema.REQUEST_FIELDS}
    for _ in range(n_requests):
        row = {
            "finished_unix_s": 1_700_000_000.5,
            "e2e_s": 1.0,
            "queue_s": 0.1,
            "prefill_s": 0.1,
            "decode_s": 0.8,
            "ttft_s": 0.2,
            "prompt_tokens": 30,
            "generation_tokens": 128,
            "cached_tokens": 0,
            "preemptions": 0,
            "finish_reason": "length",
        }
        for k, v in row.items():
            reqs[k].append(v)
    hello = {f.name: None for f in schema.HELLO_FIELDS if f.nullable}
    hello.update(
        engine_id="h:8000:0",
        boot_id="b1",
        host="h",
        port=8000,
        pid=1,
        engine_index=0,
        pool="p",
        model="m",
        started_unix_s=1_700_000_000.0,
        vllm_version="0.32.0",
        kvscope_version="0.1.0",
        num_gpu_blocks=48,
    )
    return {
        "schema_version": schema.SCHEMA_VERSION,
        "engine_id": "h:8000:0",
        "boot_id": "b1",
        "seq": 0,
        "sent_unix_s": 1_700_000_001.0,
        "hello": hello,
        "steps": steps,
        "requests": reqs,
        "exporter": {f.name: 0 for f in schema.EXPORTER_FIELDS},
    }


def test_valid_batch_passes_unchanged():
    b = make_batch()
    assert schema.validate_batch(copy.deepcopy(b)) == b


def test_empty_sections_are_valid():
    b = make_batch(0, 0)
    b["steps"], b["requests"], b["hello"] = {}, {}, None
    schema.validate_batch(b)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.update(schema_version=99), "schema_version"),
        (lambda b: b.update(extra=1), "unknown field"),
        (lambda b: b.update(seq=-1), "seq"),
        (lambda b: b.update(seq=True), "seq"),
        (lambda b: b.update(engine_id=""), "engine_id"),
        (lambda b: b.update(engine_id="x" * 500), "engine_id"),
        (lambda b: b.update(sent_unix_s=math.nan), "sent_unix_s"),
        (lambda b: b["steps"]["batch_size"].__setitem__(1, -3), "steps.batch_size[1]"),
        (lambda b: b["steps"]["batch_size"].__setitem__(0, "4"), "steps.batch_size[0]"),
        (lambda b: b["steps"]["batch_size"].__setitem__(0, 2.5), "steps.batch_size[0]"),
        (lambda b: b["steps"]["kv_usage_ratio"].__setitem__(2, 1.5), "steps.kv_usage_ratio[2]"),
        (lambda b: b["steps"]["kv_usage_ratio"].__setitem__(2, math.inf), "kv_usage_ratio[2]"),
        (lambda b: b["steps"]["ts_unix_s"].__setitem__(0, None), "steps.ts_unix_s[0]"),
        (lambda b: b["steps"]["waiting"].pop(), "steps.waiting"),
        (lambda b: b["steps"].pop("waiting"), "missing column"),
        (lambda b: b["steps"].update(bogus=[1, 2, 3]), "unknown column"),
        (lambda b: b["requests"]["finish_reason"].__setitem__(0, 7), "finish_reason[0]"),
        (lambda b: b["hello"].update(engine_id="other"), "hello"),
        (lambda b: b["hello"].pop("model"), "hello.model"),
        (lambda b: b["exporter"].update(dropped_steps=-1), "exporter.dropped_steps"),
        (lambda b: b.update(steps=[1, 2]), "steps"),
    ],
)
def test_invalid_batches_are_rejected_naming_the_field(mutate, message):
    b = make_batch()
    mutate(b)
    with pytest.raises(schema.SchemaError, match=message.replace("[", r"\[").replace("]", r"\]")):
        schema.validate_batch(b)


def test_field_names_carry_units_and_are_unique():
    for fields in (schema.STEP_FIELDS, schema.REQUEST_FIELDS, schema.HELLO_FIELDS):
        names = [f.name for f in fields]
        assert len(names) == len(set(names))
    for f in schema.STEP_FIELDS + schema.REQUEST_FIELDS:
        if f.kind == schema.FLOAT:
            assert f.name.endswith(("_s", "_ratio")), f.name


def test_optional_hello_field_may_be_missing_and_reads_as_null():
    """``kv_events_endpoint`` came after version 1: hellos without it (older plugins,
    the bundled recordings) stay valid; with it, it must be a string or null."""
    f = {x.name: x for x in schema.HELLO_FIELDS}["kv_events_endpoint"]
    assert f.optional and f.nullable
    b = make_batch()
    b["hello"].pop("kv_events_endpoint", None)
    schema.validate_batch(b)
    b["hello"]["kv_events_endpoint"] = "tcp://*:5557"
    schema.validate_batch(b)
    b["hello"]["kv_events_endpoint"] = 5557
    with pytest.raises(schema.SchemaError, match=r"hello\.kv_events_endpoint"):
        schema.validate_batch(b)
    # A required field stays required.
    b = make_batch()
    b["hello"].pop("pool")
    with pytest.raises(schema.SchemaError, match=r"hello\.pool: missing"):
        schema.validate_batch(b)


def test_optional_field_must_be_nullable():
    with pytest.raises(ValueError, match="nullable"):
        schema.Field("x", schema.STR, "doc", optional=True)


def test_recorded_hellos_without_the_new_field_still_validate():
    from pathlib import Path

    from kvscope.lab.recording import load_recording

    recordings = sorted((Path(__file__).parents[1] / "lab" / "recordings").glob("*.jsonl.gz"))
    assert recordings
    for path in recordings:
        hellos = [b["hello"] for b in load_recording(path).batches if b.get("hello")]
        assert hellos, path
        assert all("kv_events_endpoint" not in h for h in hellos)


_ODD_VALUES = [
    0,
    1,
    -1,
    2.5,
    -0.0,
    1.0,
    1.5,
    2**70,
    -(2**70),
    1e308,
    math.inf,
    -math.inf,
    math.nan,
    None,
    True,
    False,
    "4",
    "x" * 40,
    [],
    {},
]


@pytest.mark.parametrize("f", schema.STEP_FIELDS + schema.REQUEST_FIELDS, ids=lambda f: f.name)
def test_column_fast_path_accepts_only_what_value_checks_accept(f):
    import random

    rng = random.Random(f.name)
    valid = make_batch(4, 4)["steps" if f in schema.STEP_FIELDS else "requests"][f.name]
    for _ in range(300):
        col = list(valid)
        for _ in range(rng.randint(0, 3)):
            col[rng.randrange(len(col))] = rng.choice(_ODD_VALUES)
        try:
            for v in col:
                schema._check_value(f.name, f, v)
            accepted = True
        except schema.SchemaError:
            accepted = False
        if schema._column_ok(f, col):
            assert accepted, (f.name, col)
    assert schema._column_ok(f, valid), "a valid column should take the fast path"
