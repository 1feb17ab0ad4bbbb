"""Property-based fuzzing (Hypothesis) of a real collector process: the ingest schema and
the read API.

Ingest: batches that are valid but for one to three mutations (a value at a physical bound
or past it, 2^63-1, 1e308, NaN or inf as numbers or strings, a lone surrogate, a wrong
type, a missing or extra field, a time far ahead or behind the collector's clock), so they
get past the envelope into the columns, the time bounds, the pool tokens and the writer;
beside them fully random JSON, deep or huge bodies and broken encodings. Each answer is one
the service means (``INGEST_STATUSES``; a 400 names the field), never a 500 or a dropped
connection, and an unmutated batch is stored. Reads: every route of the read API with
generated parameters (``since=1e308``, ``since=99999999999999999999w``, ``every=10**30``,
``limit=-1``, unknown names, lone surrogates, bytes that are not UTF-8...): never a 500.

Named examples (``_named_cases``, ``NAMED_QUERIES``) run first on every run, each ingest one
with the field its 400 must name. After the examples ``/metrics`` passes ``promtool check
metrics``, the collector logged no error, stops cleanly on SIGTERM, and a new one on the
same store answers ``/healthz``, ``/v1/totals`` and a ``/metrics`` that promtool accepts.

The default run draws ``DEFAULT_EXAMPLES`` ingest examples and as many queries, from a
fixed seed; a longer or another run::

    KVSCOPE_FUZZ_EXAMPLES=20000 KVSCOPE_FUZZ_SEED=7 \\
        .venv/bin/pytest tests/faults_collector/test_fuzz_collector.py
"""

from __future__ import annotations

import copy
import functools
import gzip
import http.client
import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _faults_collector_helpers import batch, encode, request, start_collector
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from kvscope.collector.process import CollectorProcess
from kvscope.engine_plugins.schema import (
    BOOL,
    ENVELOPE_KEYS,
    EXPORTER_FIELDS,
    FLOAT,
    HELLO_FIELDS,
    INT,
    MAX_ID_CHARS,
    MAX_ROWS_PER_BATCH,
    REQUEST_FIELDS,
    SCHEMA_VERSION,
    STEP_FIELDS,
    STR,
    Field,
)

pytestmark = pytest.mark.promtool

DEFAULT_EXAMPLES = 1500
EXAMPLES = int(os.environ.get("KVSCOPE_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
"""Ingest examples (shared by the two ingest runs) and read-API queries, each."""
SEED = int(os.environ.get("KVSCOPE_FUZZ_SEED", "44"))

FLEET_TOKEN = "fuzz-fleet-token"
POOL_TOKEN = "fuzz-pool-a-token"
TOKEN_FLAGS = ("--pool-token", f"pool-a={POOL_TOKEN}", "--retention-interval", "1s")
"""A pool's token beside the fleet's (403s), and the rollup and retention every second so
they run over the fuzzed rows while the examples go on."""
DEFAULT_BOUNDS = ("--max-backfill", "15d")
"""After the helpers' ``--max-backfill 0`` on the command line: argparse keeps the last."""

INGEST_STATUSES = frozenset({200, 400, 403, 409, 413, 415, 429, 503})
READ_STATUSES = frozenset({200, 400, 403})
SECTION_FIELDS = {
    "hello": HELLO_FIELDS,
    "exporter": EXPORTER_FIELDS,
    "steps": STEP_FIELDS,
    "requests": REQUEST_FIELDS,
}
TIME_FIELDS = frozenset({"ts_unix_s", "finished_unix_s", "started_unix_s"})
DAY_S = 86_400.0


def _fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=max(n, 1),
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )


# -- values ------------------------------------------------------------------------------

SURROGATES = st.characters(categories=["Cs"])
ANY_CHAR = st.one_of(
    st.characters(exclude_categories=()),
    SURROGATES,
    st.sampled_from(['"', "\\", "\n", "\x00", "\u2028", "\ufeff", "=", "&", "%", "é", "😀"]),
)
"""Any code point, lone surrogates and the characters exposition formats escape included."""
VALID_CHAR = st.characters(exclude_categories=["Cs"])

EXTREME_INTS = [0, -1, 1, 2**16, 2**16 + 1, 2**24, 2**24 + 1, 2**31, 2**32, 2**32 + 1]
EXTREME_INTS += [2**33, 2**33 + 1, 2**53, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1]
EXTREME_INTS += [2**64, 10**30, -(10**30), 10**300]
EXTREME_FLOATS = [0.0, -0.0, 5e-324, -5e-324, 1e-300, 1.0 + 1e-6, 1.0000011, 2.0**33, 2.0**63]
EXTREME_FLOATS += [30 * DAY_S, 30 * DAY_S + 1, 1e308, -1e308, 1.7976931348623157e308]
EXTREME_FLOATS += [math.inf, -math.inf, math.nan, 0.5, 1e-9]
EXTREME_STRS = ["", " ", "NaN", "nan", "inf", "-inf", "Infinity", "1e308", "-1", "0x10"]
EXTREME_STRS += ["9223372036854775807", "\ud800", "a\udfffb", "\udc80\ud800", "\x00", "\n"]
EXTREME_STRS += ['q"uo\\te', "x" * 33, "x" * 65, "x" * 201, "x" * 1001, "é" * 33, "😀" * 201]
EXTREME_STRS += ["\u2028", "stop", "length", "pool-a", "fz-0"]
OTHERS: list[Any] = [None, True, False, [], {}, [1], [[1]], {"a": 1}, [None], [math.nan]]

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(ANY_CHAR, max_size=12),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(ANY_CHAR, max_size=12), inner, max_size=5)
    ),
    max_leaves=16,
)
EVIL = st.one_of(
    st.sampled_from(EXTREME_INTS),
    st.sampled_from(EXTREME_FLOATS),
    st.sampled_from(EXTREME_STRS),
    st.sampled_from(OTHERS).map(copy.deepcopy),
    st.integers(),
    st.floats(),
    st.text(ANY_CHAR, max_size=40),
    JSON_VALUES,
)
"""A value out of place: at or past a bound, of another type, or not text at all."""


def _weighted(*options: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of ``options``, each drawn ``weight`` times in ``sum(weights)``."""
    pool = [s for w, s in options for _ in range(w)]
    index = st.integers(0, len(pool) - 1)

    @st.composite
    def pick(draw: st.DrawFn) -> Any:
        return draw(pool[draw(index)])

    return pick()


def _valid_value(f: Field, t_lo: float, t_hi: float) -> st.SearchStrategy[Any]:
    """Values the schema accepts for ``f``: mostly its bounds and a few typical values (one
    cheap draw), else any value between its bounds."""
    s: st.SearchStrategy[Any]
    if f.name in TIME_FIELDS:
        s = st.sampled_from([t_lo, t_hi, (t_lo + t_hi) / 2]) | st.floats(t_lo, t_hi)
    elif f.kind == INT:
        lo, hi = int(f.minimum or 0), int(f.maximum or 2**53)
        s = st.sampled_from(sorted({lo, hi, hi // 2, min(hi, 1), min(hi, 100)}))
        s |= st.integers(lo, hi)
    elif f.kind == FLOAT:
        lo_f, hi_f = float(f.minimum or 0.0), float(f.maximum or 1e9)
        s = st.sampled_from([lo_f, hi_f, hi_f / 2, min(hi_f, 0.25)]) | st.floats(lo_f, hi_f)
    elif f.kind == STR:
        s = st.sampled_from(["stop", "length", "", "x" * f.max_chars, "é" * f.max_chars])
        s |= st.text(VALID_CHAR, max_size=min(f.max_chars, 8))
    else:
        assert f.kind == BOOL
        s = st.booleans()
    return s | st.none() if f.nullable else s


ENGINES = ["fz-0", "fz-1", "fz-2", 'fz"q\\u\nte']
POOLS = ["pool-a", "pool-b"]
READ_ENGINES = [*ENGINES, "fz-😀"]
IDS = _weighted(
    (6, st.sampled_from(ENGINES)), (1, st.text(VALID_CHAR, min_size=1, max_size=MAX_ID_CHARS))
)
BOOT_IDS = _weighted(
    (8, st.sampled_from(["b0", "b1"])),
    (2, st.sampled_from([f"boot-{i}" for i in range(30)])),
    (1, IDS),
)
"""Mostly two boots an engine; sometimes many (past the new-boot limit: 429)."""
SEQS = st.integers(0, 50) | st.sampled_from([0, 2**53])


@functools.lru_cache(maxsize=16)
def _values(section: str, t_lo: float, t_hi: float) -> dict[str, st.SearchStrategy[Any]]:
    """Each field's valid values (built once: a strategy is cheap to draw from, not to
    build)."""
    return {f.name: _valid_value(f, t_lo, t_hi) for f in SECTION_FIELDS[section]}


@st.composite
def _record(draw: st.DrawFn, section: str, t_lo: float, t_hi: float) -> dict[str, Any]:
    """A valid hello or exporter record (optional fields present or not)."""
    fields = SECTION_FIELDS[section]
    values = _values(section, t_lo, t_hi)
    return {f.name: draw(values[f.name]) for f in fields if not f.optional or draw(st.booleans())}


@st.composite
def _columns(draw: st.DrawFn, section: str, n_rows: int, t_lo: float, t_hi: float) -> Any:
    """Valid columns of ``n_rows`` values: one value a column, then up to three cells
    changed (far fewer draws than a value a cell, and as deep into the collector)."""
    values = _values(section, t_lo, t_hi)
    cols = {name: [draw(v)] * n_rows for name, v in values.items()}
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(sorted(values)))
        cols[name][draw(st.integers(0, n_rows - 1))] = draw(values[name])
    return cols


@st.composite
def valid_batches(draw: st.DrawFn, t_lo: float, t_hi: float) -> dict[str, Any]:
    """A batch the collector must store: every value inside the schema's bounds, times in
    ``[t_lo, t_hi]``."""
    engine_id = draw(IDS)
    boot_id = draw(BOOT_IDS)
    b: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "engine_id": engine_id,
        "boot_id": boot_id,
        "seq": draw(SEQS),
        "sent_unix_s": draw(st.floats(t_lo, t_hi)),
    }
    if draw(st.booleans()):
        hello = draw(_record("hello", t_lo, t_hi))
        hello.update(engine_id=engine_id, boot_id=boot_id)
        if draw(st.integers(0, 6)):  # else the drawn text
            hello["pool"] = draw(st.sampled_from(POOLS))
        b["hello"] = hello
    elif draw(st.booleans()):
        b["hello"] = None
    for section in ("steps", "requests"):
        n = draw(st.integers(0, 6))
        if n or draw(st.booleans()):
            b[section] = draw(_columns(section, n, t_lo, t_hi)) if n else {}
    if draw(st.booleans()):
        b["exporter"] = draw(_record("exporter", t_lo, t_hi))
    return b


def _paths(b: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every key of the batch, of its records and of its columns, and every cell."""
    out: list[tuple[Any, ...]] = [(k,) for k in b]
    for section in SECTION_FIELDS:
        sub = b.get(section)
        if not isinstance(sub, dict):
            continue
        for k, v in sub.items():
            out.append((section, k))
            if isinstance(v, list):
                out += [(section, k, i) for i in range(len(v))]
    return out


def _at(b: dict[str, Any], path: tuple[Any, ...]) -> Any:
    """The container holding ``path``'s last key."""
    obj: Any = b
    for k in path[:-1]:
        obj = obj[k]
    return obj


OPERATIONS = st.sampled_from(["set", "set", "set", "time", "delete", "add", "resize"])
EXTRA_KEYS = st.sampled_from(sorted(ENVELOPE_KEYS)) | st.text(ANY_CHAR, max_size=10)


@functools.lru_cache(maxsize=4)
def _bad_times(now: float) -> st.SearchStrategy[float]:
    """Times ahead of ``now`` past the allowed skew, behind it past the backfill, and the
    schema's own bounds."""
    ago = [15 * DAY_S + 60, 365 * DAY_S, 30 * 365 * DAY_S]
    return (
        st.sampled_from([now + 301, now + 3600, now + 365 * DAY_S, now + 1e9])
        | st.sampled_from([now - a for a in ago])
        | st.sampled_from([0.0, 0, -1e-9, 2.0**33, 2**33 + 1, 1e308, 5e-324, 1.7e9])
    )


@st.composite
def mutations(draw: st.DrawFn, b: dict[str, Any], now: float) -> str:
    """Change ``b`` at one place; return what was done (for the failure report)."""
    paths = _paths(b)
    op = draw(OPERATIONS)
    if op == "time":
        times = [
            p for p in paths if p[-1] == "sent_unix_s" or (len(p) == 3 and p[1] in TIME_FIELDS)
        ]
        times += [p for p in paths if p == ("hello", "started_unix_s")]
        if times:
            path = draw(st.sampled_from(times))
            value = draw(_bad_times(now))
            _at(b, path)[path[-1]] = value
            return f"{path} = {value!r} (now {now:.0f})"
        op = "set"
    if op == "add":
        holders = [()] + [(s,) for s in SECTION_FIELDS if isinstance(b.get(s), dict)]
        where = draw(st.sampled_from(holders))
        key = draw(EXTRA_KEYS)
        value = draw(EVIL)
        (b if not where else b[where[0]])[key] = value
        return f"{where}[{key!r}] = {value!r}"
    if op == "resize":
        cols = [p for p in paths if len(p) == 2 and isinstance(_at(b, p)[p[1]], list)]
        if cols:
            path = draw(st.sampled_from(cols))
            col = _at(b, path)[path[-1]]
            if col and draw(st.booleans()):
                col.pop()
                return f"{path}: one value fewer"
            value = draw(EVIL)
            col.append(value)
            return f"{path}: appended {value!r}"
        op = "set"
    path = draw(st.sampled_from(paths))
    if op == "delete":
        del _at(b, path)[path[-1]]
        return f"del {path}"
    value = draw(EVIL)
    _at(b, path)[path[-1]] = value
    return f"{path} = {value!r}"


# -- raw bodies --------------------------------------------------------------------------

GZIP = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


@functools.lru_cache(maxsize=4)
def _rows_body(n_rows: int) -> bytes:
    """A gzip batch of ``n_rows`` steps (past ``MAX_ROWS_PER_BATCH``: refused)."""
    col: list[float] = [1] * n_rows
    steps = {f.name: col for f in STEP_FIELDS}
    steps["ts_unix_s"] = [1.7e9] * n_rows
    steps["kv_usage_ratio"] = [0.5] * n_rows
    b = {"schema_version": SCHEMA_VERSION, "engine_id": "fz-big", "boot_id": "b0", "seq": n_rows}
    return encode({**b, "sent_unix_s": 1.7e9, "steps": steps})


@functools.lru_cache(maxsize=1)
def _bomb() -> bytes:
    """65 MiB of spaces in a small gzip stream: over the decompressed limit (413)."""
    return gzip.compress(b" " * (65 * 1024 * 1024), compresslevel=1)


RAW_KINDS = _weighted(
    (6, st.just("json")),
    (6, st.just("envelope")),
    (2, st.just("deep")),
    (1, st.just("digits")),
    (2, st.just("bytes")),
    (2, st.just("not_utf8")),
    (2, st.just("encoding")),
    (1, st.just("big")),
)
DEPTHS = st.integers(1, 200_000) | st.sampled_from([999, 1000, 100_000])
ENCODINGS = st.sampled_from(["identity", "br", "deflate", "gzip, gzip", "trunc", "tail", "empty"])


@st.composite
def raw_bodies(draw: st.DrawFn) -> tuple[bytes, dict[str, str], str]:
    """(body, headers, description): not a batch at all, or not in the agreed encoding."""
    kind = draw(RAW_KINDS)
    if kind == "json":
        obj = draw(JSON_VALUES)
        return encode(obj), GZIP, f"json {obj!r}"
    if kind == "envelope":
        keys = draw(st.lists(st.sampled_from(sorted(ENVELOPE_KEYS)), unique=True))
        obj = {k: draw(EVIL) for k in keys}
        return encode(obj), GZIP, f"envelope {obj!r}"
    if kind == "deep":
        depth = draw(DEPTHS)
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"steps":', "}"), ('{"a":[', "]}")]))
        text = opener * depth + "1" + closer * depth
        return gzip.compress(text.encode(), 1), GZIP, f"nested {opener!r} x {depth}"
    if kind == "digits":
        n = draw(st.integers(1, 20_000))
        key = draw(st.sampled_from(["seq", "sent_unix_s", "schema_version"]))
        text = f'{{"schema_version": 1, "{key}": {"9" * n}}}'
        return gzip.compress(text.encode()), GZIP, f"{key}: {n} digits"
    if kind == "bytes":
        data = draw(st.binary(max_size=200))
        return gzip.compress(data), GZIP, f"bytes {data!r}"
    if kind == "not_utf8":
        text = json.dumps({"schema_version": 1, "engine_id": draw(st.text(ANY_CHAR, max_size=8))})
        raw = text.encode() + draw(st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\xc0\xaf"]))
        return gzip.compress(raw), GZIP, f"not UTF-8 {raw!r}"
    if kind == "encoding":
        good = encode({"schema_version": 1})
        variant = draw(ENCODINGS)
        headers = dict(GZIP)
        body = {
            "trunc": good[: len(good) // 2],
            "tail": good + b"garbage",
            "empty": b"",
            "identity": good[10:],
        }.get(variant, good)
        if variant in ("identity", "br", "deflate", "gzip, gzip"):
            headers["Content-Encoding"] = variant
        return body, headers, f"encoding {variant}"
    big = draw(st.sampled_from(["rows_ok", "rows_over", "bomb"]))
    if big == "bomb":
        return _bomb(), GZIP, "gzip bomb"
    n = MAX_ROWS_PER_BATCH + 1 if big == "rows_over" else 20_000
    return _rows_body(n), GZIP, f"{n} rows"


# -- the collector -----------------------------------------------------------------------


def _auth(token: str = FLEET_TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _call(
    c: CollectorProcess, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> tuple[int, bytes]:
    """One request; a dropped connection or a dead collector fails the example."""
    try:
        status, _, data = request(c.url, method, path, body, headers, timeout_s=60.0)
    except (OSError, http.client.HTTPException) as exc:
        alive = c.proc is not None and c.proc.poll() is None
        raise AssertionError(
            f"{method} {path[:200]}: {type(exc).__name__}: {exc} (collector "
            f"{'alive' if alive else 'DEAD'})\n{c.log_tail()}"
        ) from None
    return status, data


def _error(data: bytes) -> str:
    try:
        err = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"a 4xx without a JSON error: {data[:300]!r}") from None
    assert isinstance(err, str) and err, data[:300]
    return err


_WHERE = re.compile(r"^([a-z0-9_]+)((?:\.[a-z0-9_]+)?)(?:\[\d+\])?: ")


def _names_field(err: str) -> bool:
    """Whether an ingest error starts with the field it is about (``steps.ts_unix_s[3]: ``,
    ``seq: ``, ``body: ``)."""
    m = _WHERE.match(err)
    if m is None:
        return False
    head, sub = m.group(1), m.group(2)[1:]
    if head in ("body", "batch") or (head in ENVELOPE_KEYS and not sub):
        return True
    return head in SECTION_FIELDS and sub in {f.name for f in SECTION_FIELDS[head]}


def promtool_check(text: str) -> None:
    """``promtool check metrics`` accepts ``text`` without a complaint (as in
    tests/collector/test_metrics.py)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: install the Debian 'prometheus' package"
    res = subprocess.run(
        [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60
    )
    out = (res.stdout + res.stderr).decode(errors="replace")
    assert res.returncode == 0 and not out.strip(), out


_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ([A-Z]+) ", re.M)


def _exceptions(log: str) -> list[str]:
    """The errors a collector logged: ERROR and CRITICAL records, and output that is no
    record (a crash's traceback). A malformed HTTP request, which aiohttp answers 400
    itself, is a one-line WARNING a minute (``MalformedRequestLog``), not an error."""
    starts = [m.start() for m in _RECORD.finditer(log)]
    records = [log[a:b] for a, b in zip(starts, [*starts[1:], len(log)], strict=True)]
    stray = log[: starts[0]] if starts else log
    found = [stray] if stray.strip() else []
    for r in records:
        level = _RECORD.match(r)
        bad = level is not None and level.group(1) in ("ERROR", "CRITICAL")
        if bad:
            found.append(r[:3000])
    return found


def _check_service(c: CollectorProcess) -> None:
    status, data = _call(c, "GET", "/metrics", None, _auth())
    assert status == 200, data[:300]
    promtool_check(data.decode())


def _fuzz_then_restart(
    store: Path, flags: tuple[str, ...], fuzz: Callable[[CollectorProcess], None]
) -> None:
    """Start a collector, fuzz it, check /metrics and its log, stop it with SIGTERM and
    check that a new one on the same store serves."""
    c = start_collector(store, *TOKEN_FLAGS, *flags, token=FLEET_TOKEN)
    try:
        fuzz(c)
        _check_service(c)
    finally:
        code = c.stop()
    assert code == 0, f"exit code {code} after SIGTERM\n{c.log_tail()}"
    c2 = start_collector(store, *TOKEN_FLAGS, *flags, token=FLEET_TOKEN)
    try:
        health = json.loads(c2.request("/healthz")[1])
        assert health["status"] == "ok", health
        status, data = _call(c2, "GET", "/v1/totals", None, _auth())
        assert status == 200, data[:300]
        _check_service(c2)
    finally:
        c2.stop()
    logged = _exceptions(c2.log_path.read_text(errors="replace"))
    assert not logged, "the collector logged exceptions:\n\n" + "\n\n".join(logged[:5])


STORED = "stored"


def check_ingest(
    c: CollectorProcess, what: str, status: int, data: bytes, expect: str | None
) -> None:
    """An ingest answer is one the service means and a 400 names a field; with ``expect``
    ``STORED`` the batch is stored (or refused for a rate limit, or overload), with a field's
    name a 400 names that field."""
    assert status in INGEST_STATUSES, f"{status} {data[:500]!r} to {what}\n{c.log_tail()}"
    err = _error(data) if status == 400 else ""
    if status == 400:
        assert _names_field(err), f"a 400 that names no field: {err!r}"
    if status == 200:
        assert json.loads(data)["status"] in ("stored", "duplicate"), data
    if expect == STORED:
        assert status in (200, 429, 503), f"a valid batch refused: {status} {data[:300]!r}"
    elif expect is not None:
        assert status == 400 and err.startswith(expect), f"{what}: {status} {data[:300]!r}"


def check_read(c: CollectorProcess, path: str, route: str, status: int, data: bytes) -> None:
    """A read answer is 200 with rows, or a 400 or 403 with an error (404: an unknown
    engine's configs), never a 500."""
    allowed = READ_STATUSES | ({404} if "{id}" in route else set())
    assert status in allowed, f"{status} {data[:500]!r} to {path}\n{c.log_tail()}"
    if status == 200:
        assert "n_rows" in json.loads(data), data[:300]
    elif data.startswith(b"{"):  # else aiohttp's own 400 (an over-long request line)
        _error(data)


# -- ingest ------------------------------------------------------------------------------


IngestCase = tuple[bytes, dict[str, str], str, str | None]
"""(body, headers, description, expected outcome: see `check_ingest`)."""
INGEST_TOKENS = _weighted((7, st.just(FLEET_TOKEN)), (1, st.just(POOL_TOKEN)))
N_MUTATIONS = st.integers(0, 3) | st.integers(1, 3)
"""Mutations of a valid batch: none in one case of eight."""


@st.composite
def ingest_cases(draw: st.DrawFn, t_lo: float, t_hi: float, now: float) -> IngestCase:
    """A generated ingest request."""
    token = draw(INGEST_TOKENS)
    if draw(st.integers(0, 4)) == 0:
        body, headers, what = draw(raw_bodies())
        return body, {**headers, **_auth(token)}, what, None
    b = draw(valid_batches(t_lo, t_hi))
    n = draw(N_MUTATIONS)
    done = [draw(mutations(b, now)) for _ in range(n)]
    what = f"batch {b!r}; mutations {done}"
    expect = STORED if not done and token == FLEET_TOKEN else None
    return encode(b), {**GZIP, **_auth(token)}, what, expect


def _named_cases(now: float, bounded: bool) -> list[IngestCase]:
    """The extremes the fuzz always tries, each in an otherwise valid batch, with the field
    the 400 must name (from the schema's bounds and the collector's time bounds)."""
    t = now - 60
    changes: list[tuple[tuple[Any, ...], Any, str]] = [
        (("steps", "step", 0), 2**63 - 1, "steps.step[0]: "),
        (("steps", "waiting", 0), 2**63, "steps.waiting[0]: "),
        (("steps", "prompt_tokens", 1), -1, "steps.prompt_tokens[1]: "),
        (("steps", "kv_usage_ratio", 0), 1e308, "steps.kv_usage_ratio[0]: "),
        (("steps", "iteration_s", 0), math.nan, "steps.iteration_s[0]: "),
        (("requests", "e2e_s", 0), math.inf, "requests.e2e_s[0]: "),
        (("requests", "queue_s", 0), "NaN", "requests.queue_s[0]: "),
        (("requests", "finish_reason", 0), "\ud800", "requests.finish_reason[0]: "),
        (("hello", "pool"), "\udfff", "hello.pool: "),
        (("engine_id",), "fz-\ud800", "engine_id: "),
        (("seq",), 10**30, "seq: "),
        (("schema_version",), [1], "schema_version: "),
        (("schema_version",), True, "schema_version: "),
        (("seq",), True, "seq: "),
        (("steps", "batch_size", 0), True, "steps.batch_size[0]: "),
        (("steps", "ts_unix_s", 1), now + 3600, "steps.ts_unix_s: "),
        (("hello", "started_unix_s"), 2.0**33, "hello.started_unix_s: "),
        (("sent_unix_s",), -1e308, "sent_unix_s: "),
        (("requests", "finished_unix_s", 0), 0.0, "requests.finished_unix_s: "),
    ]
    out: list[IngestCase] = []
    for path, value, field in changes:
        b = batch("fz-named", "b0", 0, with_hello=True, step_ts=[t, t + 1], req_ts=[t + 0.5])
        _at(b, path)[path[-1]] = value
        expect = STORED if field.startswith("requests.finished") and not bounded else field
        out.append((encode(b), {**GZIP, **_auth()}, f"{path} = {value!r}", expect))
    deep = gzip.compress(b"[" * 100_000 + b"]" * 100_000)
    out.append((deep, {**GZIP, **_auth()}, "nested 100,000 deep", "body: "))
    many = _rows_body(MAX_ROWS_PER_BATCH + 1)
    out.append((many, {**GZIP, **_auth()}, "too many rows", "steps"))
    return out


def _fuzz_ingest(
    c: CollectorProcess, n: int, t_lo: float, t_hi: float, now: float, bounded: bool
) -> None:
    @seed(SEED)
    @_fuzz_settings(n)
    @given(case=ingest_cases(t_lo, t_hi, now))
    def run(case: IngestCase) -> None:
        body, headers, what, expect = case
        status, data = _call(c, "POST", "/v1/ingest", body, headers)
        check_ingest(c, what, status, data, expect)

    for case in _named_cases(now, bounded):
        run = example(case=case)(run)
    run()


@pytest.mark.parametrize(
    ("bounds", "share"),
    [pytest.param(DEFAULT_BOUNDS, 2 / 3, id="time-bounds"), pytest.param((), 1 / 3, id="any-age")],
)
def test_fuzz_ingest(tmp_path: Path, bounds: tuple[str, ...], share: float) -> None:
    """Generated batches (mostly valid, mutated in a few places) and random bodies: only
    meant statuses, a 400 naming the field; then promtool and a clean restart. With the
    default time bounds (15 d behind, 5 min ahead) and with any age accepted."""
    now = time.time()
    t_lo = now - 14 * DAY_S if bounds else 0.0
    _fuzz_then_restart(
        tmp_path / "fuzz.duckdb",
        bounds,
        lambda c: _fuzz_ingest(c, round(EXAMPLES * share), t_lo, now + 60, now, bool(bounds)),
    )


# -- the read API ------------------------------------------------------------------------

RANGE = ("engine", "pool", "since", "until", "limit", "format", "fields")
ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/engines": ("format", "fields"),
    "/v1/windows": RANGE,
    "/v1/windows_1m": RANGE,
    "/v1/requests_1m": (*RANGE, "step", "deleted_only"),
    "/v1/daily_load_peaks": ("pool", "since", "until", "format", "fields"),
    "/v1/steps": (*RANGE, "every"),
    "/v1/requests": RANGE,
    "/v1/kv_events": (*RANGE, "engine_id"),
    "/v1/request_stats": ("engine", "pool", "since", "until", "group_by", "format", "fields"),
    "/v1/totals": ("engine", "source", "format"),
    "/v1/engines/{id}/configs": ("format",),
}
"""Each route and the parameters it takes (the fuzz draws others too)."""
PARAM_NAMES = sorted({p for ps in ROUTES.values() for p in ps})

TIME_TEXTS = ["1h", "now", "now-1h", "-1h", "+1h", "0", "-0", "1e308", "-1e308", "nan", "inf"]
TIME_TEXTS += ["99999999999999999999w", "1e400", "1.5h30m", "2026-11-30T08:00Z", "9999-12-31"]
TIME_TEXTS += ["0001-01-01", "2026-13-45", "2026-11-30T08:00+25:00", "1764490000", "8589934593"]
TIME_TEXTS += [str(2**63 - 1), "1e-320", "now - 1w", "1w1w1w", "1" + "0" * 400 + "s", "٣h"]
INT_TEXTS = ["-1", "0", "1", str(10**30), str(2**31), str(2**31 + 1), str(2**63), "1_000"]
INT_TEXTS += [" 5 ", "0x10", "1e3", "1.5", "٣", "１", "+7", "-0", "9" * 5000, "1000000", "1000001"]
GARBAGE = st.one_of(
    st.text(ANY_CHAR, max_size=30),
    st.integers().map(str),
    st.floats().map(repr),
    st.sampled_from(TIME_TEXTS + INT_TEXTS),
)


@functools.lru_cache(maxsize=64)
def _param_values(name: str, columns: tuple[str, ...]) -> st.SearchStrategy[str]:
    """Values of parameter ``name``: its meaningful ones, extremes, and garbage."""
    meaningful: dict[str, st.SearchStrategy[str]] = {
        "since": st.sampled_from(TIME_TEXTS)
        | st.builds("{}{}".format, st.integers(0, 10**30), st.sampled_from("smhdw"))
        | st.floats(allow_nan=True).map(repr)
        | st.datetimes().map(lambda d: d.isoformat() + "Z"),
        "limit": st.sampled_from(INT_TEXTS) | st.integers(-(2**70), 2**70).map(str),
        "step": st.sampled_from(["60", "90", "1m", "1h", "60.0", "1e308", str(10**30), "0"])
        | st.integers(0, 10**20).map("{}m".format),
        "format": st.sampled_from(["records", "columns", "csv"]),
        "group_by": st.sampled_from(["engine", "pool", "all", "host"]),
        "source": st.sampled_from(["windows", "steps", "raw"]),
        "deleted_only": st.sampled_from(["true", "false", "1", "0", "TRUE", "yes"]),
        "fields": st.lists(
            st.sampled_from(columns) | st.text(ANY_CHAR, max_size=8), max_size=4
        ).map(",".join)
        | st.sampled_from(columns).map("{0},{0}".format),
        "engine": st.sampled_from(READ_ENGINES),
        "pool": st.sampled_from([*POOLS, "pool-c"]),
    }
    alias = {"until": "since", "every": "limit", "engine_id": "engine"}
    s = meaningful.get(alias.get(name, name), GARBAGE)
    return _weighted((5, s), (1, GARBAGE))


@functools.lru_cache(maxsize=64)
def _param_names(route: str) -> st.SearchStrategy[list[str]]:
    """Names of a query's parameters: mostly those ``route`` takes."""
    name = _weighted(
        (6, st.sampled_from(ROUTES[route])),
        (2, st.sampled_from(PARAM_NAMES)),
        (1, st.text(ANY_CHAR, max_size=8)),
    )
    return st.lists(name, max_size=5)


NAMED_QUERIES = [
    ("/v1/windows", "since=1e308"),
    ("/v1/windows", "since=99999999999999999999w"),
    ("/v1/windows_1m", "until=-1e308"),
    ("/v1/steps", f"every={10**30}"),
    ("/v1/steps", "limit=-1"),
    ("/v1/steps", "fields=ts_unix_s,ts_unix_s"),
    ("/v1/requests", "engine=%ED%A0%80"),
    ("/v1/request_stats", "pool=%ED%B3%BF&group_by=pool"),
    ("/v1/requests_1m", "step=1e308"),
    ("/v1/kv_events", "engine_id=fz-0&engine=fz-1"),
    ("/v1/totals", "unknown=1"),
    ("/v1/daily_load_peaks", "since=0&until=now"),
    ("/v1/engines", "format=columns&fields=" + "x" * 9000),
]
"""The extremes the fuzz must always try (the last line is longer than aiohttp reads)."""
RAW_PARTS = st.lists(
    st.sampled_from(["since", "since=", "%", "%zz", "a=%ff%fe", "x=%ED%A0%80", ";"]), max_size=2
)
CONFIG_IDS = _weighted((3, st.sampled_from(READ_ENGINES)), (1, st.text(ANY_CHAR, max_size=12)))


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="", errors="surrogatepass")


@st.composite
def queries(draw: st.DrawFn, columns: tuple[str, ...]) -> tuple[str, str]:
    """(route, path with query string) for one GET of the read API."""
    route = draw(st.sampled_from(sorted(ROUTES)))
    names = draw(_param_names(route))
    parts = [f"{_quote(k)}={_quote(draw(_param_values(k, columns)))}" for k in names]
    parts += draw(RAW_PARTS)
    path = route.replace("{id}", _quote(draw(CONFIG_IDS)))
    return route, path + ("?" + "&".join(parts) if parts else "")


def _seed_batches(now: float) -> list[dict[str, Any]]:
    """Valid batches of engines in two pools (ids that need escaping everywhere among them):
    every value at its lower bound (in 2023), at its upper bound (now), half-way (in 1970)."""
    out: list[dict[str, Any]] = []
    pools = [POOLS[i % len(POOLS)] for i in range(len(READ_ENGINES))]
    for i, (engine, pool) in enumerate(zip(READ_ENGINES, pools, strict=True)):
        for j, (t, edge) in enumerate([(1.7e9, "minimum"), (now - 10, "maximum"), (0.0, "mean")]):

            def value(f: Field, edge: str = edge, t: float = t) -> Any:
                if f.name in TIME_FIELDS:
                    return t
                if f.kind == STR:
                    return "é" * f.max_chars if edge == "maximum" else "stop"
                if f.kind == BOOL:
                    return edge == "maximum"
                lo, hi = f.minimum or 0, f.maximum or 2**53
                v = {"minimum": lo, "maximum": hi, "mean": (lo + hi) / 2}[edge]
                return int(v) if f.kind == INT else float(v)

            hello = {f.name: value(f) for f in HELLO_FIELDS}
            hello.update(engine_id=engine, boot_id="b0", pool=pool, kv_events_endpoint=None)
            out.append(
                {
                    "schema_version": SCHEMA_VERSION,
                    "engine_id": engine,
                    "boot_id": "b0",
                    "seq": 10 * i + j,
                    "sent_unix_s": now - 10,
                    "hello": hello,
                    "steps": {f.name: [value(f)] * 3 for f in STEP_FIELDS},
                    "requests": {f.name: [value(f)] * 3 for f in REQUEST_FIELDS},
                    "exporter": {f.name: value(f) for f in EXPORTER_FIELDS},
                }
            )
    return out


def _fuzz_reads(c: CollectorProcess, n: int) -> None:
    now = time.time()
    for b in _seed_batches(now):
        status, data = _call(c, "POST", "/v1/ingest", encode(b), {**GZIP, **_auth()})
        assert status == 200, (status, data[:300], b["engine_id"], b["seq"])
    columns: set[str] = set()
    for route in ROUTES:
        if "{id}" not in route:
            status, data = _call(c, "GET", f"{route}?format=columns&since=0", None, _auth())
            if status == 200:
                columns |= set(json.loads(data)["columns"])

    @seed(SEED)
    @_fuzz_settings(n)
    @given(
        q=queries(tuple(sorted(columns))),
        token=_weighted((5, st.just(FLEET_TOKEN)), (1, st.just(POOL_TOKEN))),
    )
    def run(q: tuple[str, str], token: str) -> None:
        route, path = q
        status, data = _call(c, "GET", path, None, _auth(token))
        check_read(c, path, route, status, data)

    for route, query in NAMED_QUERIES:
        run = example(q=(route, f"{route}?{query}"), token=FLEET_TOKEN)(run)
    run()


def test_fuzz_read_api(tmp_path: Path) -> None:
    """Generated queries on every read route over stored rows at the schema's bounds: never
    a 500; then promtool and a clean restart."""
    _fuzz_then_restart(tmp_path / "reads.duckdb", (), lambda c: _fuzz_reads(c, EXAMPLES))
