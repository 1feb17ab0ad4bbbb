"""Where the weekly report reads from: a collector over HTTP, or its store file offline.

Both sources answer the advisor's :class:`~kvscope.advisor.sources.Source` questions plus
``engine_configs()``, the configuration history (one row per engine hello):

* :class:`HttpSource` is the advisor's :class:`~kvscope.advisor.sources.CollectorSource` with
  ``GET /v1/engines/{engine_id}/configs`` added.
* :class:`StoreSource` reads a store file through :class:`ReadOnlyStore`: the
  :class:`~kvscope.collector.store.Store` read methods over a read-only DuckDB connection.
  DuckDB lets one process write a file, and no other process open it meanwhile, not
  even to read: with a collector running on the file, :func:`open_store` fails with
  :class:`StoreLockedError`, whose message says to use ``--collector`` instead.
  It also answers ``window_sample`` (the advisor's input in whole time blocks, bounded
  per engine) and ``usage_days`` (per-day sums in SQL), so a week of a large fleet is
  never read into memory whole.
"""

from __future__ import annotations

import threading
import urllib.parse
from pathlib import Path

import duckdb
import pandas as pd

from kvscope.advisor.request_tier import tier_step_s, with_tier
from kvscope.advisor.sources import CollectorSource, SourceError, WindowSample
from kvscope.collector.store import Store
from kvscope.collector.tables import STORE_SCHEMA_VERSION, StoreVersionError

_NEEDED_TABLES = ("engines", "engine_configs", "windows_1s", "requests")
READ_MEMORY_LIMIT = "1536MB"
"""DuckDB's memory limit on a read-only store connection."""


class StoreOpenError(RuntimeError):
    """The store file cannot be read (missing, not a kvscope store, too new)."""


class StoreLockedError(StoreOpenError):
    """Another process (a running collector) holds the store file."""


class ReadOnlyStore(Store):
    """A :class:`~kvscope.collector.store.Store` opened read-only: its read methods work, its
    write methods fail (DuckDB refuses writes on a read-only connection). The schema is
    checked, never created or migrated; a missing table reads as empty."""

    def __init__(self, path: str) -> None:  # no Store.__init__: that one opens for writing
        self.path = path
        self._con = duckdb.connect(path, read_only=True)
        # Scanned pages stay cached up to DuckDB's limit (80% of RAM by default): a week
        # of a large fleet would fill it. The reads here sort a bounded sample at most.
        self._con.execute(f"SET memory_limit = '{READ_MEMORY_LIMIT}'")
        self._write_lock = threading.Lock()
        self._read_root = self._con.cursor()
        self._cursor_lock = threading.Lock()
        self._cursors: list[object] = []
        self._local = threading.local()
        self._closed = False
        try:
            self._check_schema()
        except BaseException:
            self.close()
            raise

    def _check_schema(self) -> None:
        tables = {
            r[0]
            for r in self._con.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema()"
            ).fetchall()
        }
        missing = [t for t in _NEEDED_TABLES if t not in tables]
        if "meta" not in tables or missing:
            raise StoreOpenError(
                f"{self.path} is not a kvscope store (no {', '.join(missing) or 'meta'} table)"
            )
        row = self._con.execute(
            "SELECT value FROM meta WHERE key = 'store_schema_version'"
        ).fetchone()
        if row is not None and int(row[0]) > STORE_SCHEMA_VERSION:
            raise StoreVersionError(
                f"store layout version {row[0]} is newer than this kvscope "
                f"supports ({STORE_SCHEMA_VERSION}); upgrade kvscope"
            )
        self.tables = tables


def open_store(path: str | Path) -> ReadOnlyStore:
    """Open a store file read-only, with a message that says what to do on failure."""
    p = Path(path)
    if not p.exists():
        raise StoreOpenError(f"no store file at {p}")
    try:
        return ReadOnlyStore(str(p))
    except duckdb.IOException as e:
        text = str(e)
        if "lock" in text.lower():
            raise StoreLockedError(
                f"the store {p} is in use by another process (a running collector holds it "
                f"open for writing, and DuckDB then lets no other process read it): read "
                f"through that collector with --collector URL instead ({text})"
            ) from e
        raise StoreOpenError(f"cannot open the store {p}: {text}") from e
    except duckdb.Error as e:
        raise StoreOpenError(f"cannot read the store {p}: {e}") from e


class StoreSource:
    """The advisor's source questions, and the configuration history, over a store."""

    def __init__(self, store: ReadOnlyStore) -> None:
        self.store = store

    def engines(self) -> pd.DataFrame:
        return self.store.engines()

    def windows(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        return self.store.windows(engine, pool, since, until)

    def requests(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        """One row per request the store keeps, and rows standing for those its request
        retention deleted (see :mod:`kvscope.advisor.request_tier`)."""
        return with_tier(
            self.store.requests(engine, pool, since, until), self._tier(since, until, engine, pool)
        )

    def minute_windows(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        """The store's downsampled tier: per engine and minute (empty for a store made
        before it)."""
        if "windows_1m" not in self.store.tables:
            return pd.DataFrame()
        return self.store.minute_windows(engine, pool, since, until)

    def seconds_aged_out(self, since: float | None, until: float | None) -> float | None:
        """Where the store's 1-second windows start, when ``[since, until)`` holds none of
        them but 1-minute windows (their seconds were deleted); None otherwise."""
        if "windows_1m" not in self.store.tables:
            return None
        if not len(self.store.minute_windows(None, None, since, until, 1)):
            return None
        w = self.store.windows(None, None, None, None, 1)
        return float(w["ts_s"].iloc[0]) if len(w) else None

    def _tier(
        self, since: float | None, until: float | None, engine: str | None, pool: str | None
    ) -> pd.DataFrame:
        """The request tier where the store's request rows were deleted (empty for a
        store made before it)."""
        if "requests_1m" not in self.store.tables:
            return pd.DataFrame()
        return self.store.request_minutes(
            engine, pool, since, until, step_s=tier_step_s(since, until), deleted_only=True
        )

    def kv_events(
        self, since: float | None = None, until: float | None = None, pool: str | None = None
    ) -> pd.DataFrame:
        if "kv_event_windows" not in self.store.tables:
            return pd.DataFrame()
        return self.store.kv_event_windows(None, pool, since, until)

    def engine_configs(self) -> pd.DataFrame:
        return self.store.engine_configs()

    def window_sample(
        self,
        since: float | None = None,
        until: float | None = None,
        *,
        pool: str | None = None,
        max_windows_per_engine: int,
    ) -> WindowSample:
        """Whole 5-minute blocks, about ``max_windows_per_engine`` windows per engine,
        read in SQL; the true counts beside them (see :class:`~advisor.WindowSample`)."""
        s = self.store.window_sample(max_windows_per_engine, pool, since, until)
        return WindowSample(
            windows=s["windows"],
            requests=with_tier(s["requests"], self._tier(since, until, None, pool)),
            kv_events=s["kv_events"] if "kv_event_windows" in self.store.tables else pd.DataFrame(),
            counts=s["counts"],
        )

    def usage_days(self, knees: pd.DataFrame, since: float, until: float) -> pd.DataFrame:
        """Per engine and UTC day: the sums :func:`kvscope.advisor.usage.usage_from_days` takes,
        computed by DuckDB over every window of the range."""
        return self.store.usage_days(knees, since, until)

    def daily_load_peaks(
        self, since: float | None = None, until: float | None = None, *, pool: str | None = None
    ) -> pd.DataFrame:
        """Per engine and UTC day, the highest load from the 1-minute windows (empty for
        a store made before them)."""
        if "windows_1m" not in self.store.tables:
            return pd.DataFrame()
        return self.store.daily_load_peaks(pool, since, until)

    def close(self) -> None:
        self.store.close()


class HttpSource(CollectorSource):
    """:class:`~kvscope.advisor.sources.CollectorSource` plus the configuration history."""

    def engine_configs(self) -> pd.DataFrame:
        """Every engine's ``GET /v1/engines/{engine_id}/configs``, concatenated."""
        engines = self.engines()
        frames = []
        for eid in engines.get("engine_id", []):
            path = f"/v1/engines/{urllib.parse.quote(str(eid), safe='')}/configs"
            frames.append(self._frame(self._get(path, {"format": "columns"})))
        frames = [f for f in frames if len(f)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def daily_load_peaks(
        self, since: float | None = None, until: float | None = None, *, pool: str | None = None
    ) -> pd.DataFrame:
        """``GET /v1/daily_load_peaks``: per engine and UTC day, the highest load from the
        collector's 1-minute windows (empty from a collector without them)."""
        params: dict[str, str] = {"format": "columns"}
        # unix seconds, never negative (a minus sign reads as "ago" in the time syntax)
        if since is not None:
            params["since"] = repr(max(0.0, float(since)))
        if until is not None:
            params["until"] = repr(max(0.0, float(until)))
        if pool is not None:
            params["pool"] = pool
        try:
            return self._frame(self._get("/v1/daily_load_peaks", params))
        except SourceError as exc:
            if exc.status == 404:
                return pd.DataFrame()
            raise

    def close(self) -> None:
        return None
