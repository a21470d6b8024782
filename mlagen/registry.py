"""SQLite registry of built variants, verifications and benchmarks (under MLAGEN_CACHE_DIR).

Tables:
- ``variants``: uri, spec name, variant fields (JSON), bucket, source hash, nvcc version, archs,
  .so path, build seconds, per-arch ptxas resources (JSON), build time.
- ``verifications``: uri, source hash, device name, arch, number of cases, max abs error, pass.
- ``benchmarks``: uri, source hash, device, arch, shape (JSON), median µs, GB/s, mlagen version, time.
- ``bench_runs``: one JSON record per ``mlagen bench`` run (device, driver, versions, every row).
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from mlagen import __version__, paths

_SCHEMA = """
CREATE TABLE IF NOT EXISTS variants (
  uri TEXT PRIMARY KEY, spec TEXT, variant_json TEXT NOT NULL, bucket TEXT NOT NULL,
  source_hash TEXT NOT NULL, nvcc_version TEXT NOT NULL, archs TEXT NOT NULL, so_path TEXT NOT NULL,
  build_seconds REAL, resources_json TEXT, built_at REAL, mlagen_version TEXT);
CREATE TABLE IF NOT EXISTS verifications (
  id INTEGER PRIMARY KEY AUTOINCREMENT, uri TEXT NOT NULL, source_hash TEXT NOT NULL, device TEXT, arch TEXT,
  cases INTEGER, max_err REAL, passed INTEGER, detail_json TEXT, at REAL);
CREATE TABLE IF NOT EXISTS benchmarks (
  id INTEGER PRIMARY KEY AUTOINCREMENT, uri TEXT NOT NULL, source_hash TEXT NOT NULL, device TEXT, arch TEXT,
  shape_json TEXT, median_us REAL, gbs REAL, frac_copy_bw REAL, mlagen_version TEXT, at REAL);
CREATE TABLE IF NOT EXISTS bench_runs (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL, record_json TEXT);
"""


_LOCK_WAIT_S = 60  # how long a call waits for another process's write lock (sqlite3 busy timeout), s


class RegistryError(RuntimeError):
    """The registry file cannot be used: not an SQLite database, a damaged row, or another process held its write
    lock past the wait; the message names the file and what to do."""


class Registry:
    """Thin wrapper over one sqlite3 database file; safe across processes (sqlite's own locking). Its methods raise
    :class:`RegistryError` when the file is not a usable registry."""

    def __init__(self, path: str | Path | None = None, *, create: bool = True):
        """Open (``create``: create when missing) the registry at ``path`` (default :func:`mlagen.paths.registry_path`).

        With ``create=False`` a missing file is read as an empty registry and nothing is written to disk (the read-only
        commands: ``list``, ``show``, ``install``'s lookup), so a mistyped uri on a fresh machine leaves no cache behind.
        """
        from mlagen import owned

        self.path = Path(path) if path else paths.registry_path()
        anc = self.path.parent
        while not anc.exists() and anc != anc.parent:
            anc = anc.parent
        # a missing file under a directory path (an ancestor that is a file fails below, with the usual hint)
        self._empty = not create and not self.path.exists() and anc.is_dir()
        if self._empty:
            return
        owned.record(self.path)  # `mlagen clean --all` deletes it (and only files recorded so)
        with self._conn() as c:
            c.executescript(_SCHEMA)

    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(":memory:" if self._empty else self.path, timeout=_LOCK_WAIT_S)
        if self._empty:
            conn.executescript(_SCHEMA)
        conn.row_factory = sqlite3.Row
        try:
            with conn:
                yield conn
        except sqlite3.OperationalError as e:
            if "locked" in str(e):
                raise RegistryError(f"{self.path}: another mlagen process held the registry's write lock for "
                                    f"{_LOCK_WAIT_S} s (a long build or bench?); try again when it is done") from e
            raise
        except sqlite3.DatabaseError as e:
            if "not a database" in str(e) or "malformed" in str(e):
                raise RegistryError(f"{self.path}: not a usable mlagen registry ({e}); move it away, or remove it "
                                    "with `mlagen clean --all` if mlagen wrote it, and build again") from e
            raise
        finally:
            conn.close()

    def _variant_row(self, row: sqlite3.Row) -> dict:
        d = dict(row)
        try:
            d["variant"] = json.loads(d.pop("variant_json"))
            d["resources"] = json.loads(d.pop("resources_json") or "{}")
            d["archs"] = d["archs"].split(",")
            if not isinstance(d["variant"], dict) or not isinstance(d["resources"], dict):
                raise TypeError("not a JSON object")
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise RegistryError(f"{self.path}: damaged row for {d.get('uri')!r} ({type(e).__name__}: {e}); remove "
                                "the registry with `mlagen clean --all` and build again") from None
        return d

    # ---- variants
    def put_variant(self, *, uri: str, spec: str, variant: dict, bucket: str, source_hash: str, nvcc_version: str,
                    archs: list[str], so_path: str, build_seconds: float, resources: dict) -> None:
        """Insert or replace the row of ``uri`` (``variant``: :meth:`~mlagen.spec.Variant.to_dict`; ``resources``:
        per-arch ptxas resources; ``build_seconds``: s), stamped with the time and mlagen's version."""
        with self._conn() as c:
            c.execute(
                "INSERT OR REPLACE INTO variants VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (uri, spec, json.dumps(variant), bucket, source_hash, nvcc_version, ",".join(archs), so_path,
                 build_seconds, json.dumps(resources), time.time(), __version__),
            )

    def get_variant(self, uri: str) -> dict | None:
        """The row of ``uri`` (``variant`` and ``resources`` decoded from JSON, ``archs`` a list), or None."""
        with self._conn() as c:
            row = c.execute("SELECT * FROM variants WHERE uri=?", (uri,)).fetchone()
        return self._variant_row(row) if row else None

    def variants(self, pattern: str | None = None) -> list[dict]:
        """All registered variants (uri matching ``pattern`` when given: a shell glob or comma-separated
        globs, as ``mlagen.spec.uri_matches``), by uri.

        Raises:
            ValueError: the pattern names no glob (only commas / spaces) or a comma splits a [...] set (:func:`mlagen.spec.uri_globs`).
        """
        from mlagen.spec import uri_matches

        with self._conn() as c:
            rows = c.execute("SELECT * FROM variants ORDER BY uri").fetchall()
        return [v for v in (self._variant_row(r) for r in rows) if uri_matches(v["uri"], pattern)]

    def module_variants(self, source_hash: str) -> list[dict]:
        """The rows (as :meth:`get_variant`) of the variants compiled from ``source_hash``: one module (the hash covers
        its source, flags and toolchain), whose nsplit siblings need no compile (:func:`mlagen.build.build`)."""
        with self._conn() as c:
            rows = c.execute("SELECT * FROM variants WHERE source_hash=? ORDER BY uri", (source_hash,)).fetchall()
        return [self._variant_row(r) for r in rows]

    def drop_stale_build(self, build_key: str, source_hash: str) -> int:
        """Delete variants compiled into module ``build_key`` from another source hash (they would
        point at an older .so). Returns how many rows went."""
        from mlagen.spec import Variant

        stale = [r["uri"] for r in self.variants()
                 if r["source_hash"] != source_hash and Variant.from_dict(r["variant"]).build_key == build_key]
        with self._conn() as c:
            c.executemany("DELETE FROM variants WHERE uri=?", [(u,) for u in stale])
        return len(stale)

    def delete_variant(self, uri: str) -> None:
        """Delete the row of ``uri`` (nothing when there is none); its verifications and benchmarks stay."""
        with self._conn() as c:
            c.execute("DELETE FROM variants WHERE uri=?", (uri,))

    # ---- verifications
    def add_verification(self, *, uri: str, source_hash: str, device: str, arch: str, cases: int, max_err: float,
                         passed: bool, detail: Any = None) -> None:
        """Append a verification of ``uri`` built from ``source_hash`` on ``device`` / ``arch``: ``cases`` run, the
        largest abs error ``max_err``, ``passed``, and ``detail`` (anything JSON-serializable)."""
        with self._conn() as c:
            c.execute(
                "INSERT INTO verifications (uri, source_hash, device, arch, cases, max_err, passed, detail_json, at)"
                " VALUES (?,?,?,?,?,?,?,?,?)",
                (uri, source_hash, device, arch, cases, max_err, int(passed), json.dumps(detail), time.time()),
            )

    def last_verification(self, uri: str, source_hash: str | None = None, arch: str | None = None) -> dict | None:
        """The latest verification row of ``uri`` (of that ``source_hash`` and on that ``arch`` when given), or None;
        ``passed`` is 0 / 1 and ``detail_json`` stays JSON text."""
        q = "SELECT * FROM verifications WHERE uri=?"
        args: list = [uri]
        if source_hash:
            q += " AND source_hash=?"
            args.append(source_hash)
        if arch:
            q += " AND arch=?"
            args.append(arch)
        with self._conn() as c:
            row = c.execute(q + " ORDER BY id DESC LIMIT 1", args).fetchone()
        return dict(row) if row else None

    # ---- benchmarks
    def add_benchmark(self, *, uri: str, source_hash: str, device: str, arch: str, shape: dict, median_us: float,
                      gbs: float, frac_copy_bw: float | None) -> None:
        """Append a benchmark of ``uri`` at ``shape`` (:class:`mlagen.bench.Shape` as a dict): ``median_us`` in µs,
        ``gbs`` in GB/s (1e9 B/s) of the algorithmic bytes, ``frac_copy_bw`` that bandwidth as a fraction of the
        device's copy bandwidth (None when not measured)."""
        with self._conn() as c:
            c.execute(
                "INSERT INTO benchmarks (uri, source_hash, device, arch, shape_json, median_us, gbs, frac_copy_bw,"
                " mlagen_version, at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (uri, source_hash, device, arch, json.dumps(shape, sort_keys=True), median_us, gbs, frac_copy_bw,
                 __version__, time.time()),
            )

    def benchmarks(self, uri: str | None = None) -> list[dict]:
        """Benchmark rows (of ``uri`` when given, else all) in insertion order, ``shape`` decoded from JSON."""
        q, args = "SELECT * FROM benchmarks", []
        if uri:
            q, args = q + " WHERE uri=?", [uri]
        with self._conn() as c:
            rows = c.execute(q + " ORDER BY id", args).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["shape"] = json.loads(d.pop("shape_json"))
            out.append(d)
        return out

    def best_time(self, uri: str, source_hash: str | None = None) -> float | None:
        """The smallest median_us (µs) recorded for ``uri`` (built from ``source_hash`` when given), over every
        shape, device and arch; None without benchmarks."""
        q, args = "SELECT MIN(median_us) FROM benchmarks WHERE uri=?", [uri]
        if source_hash:
            q, args = q + " AND source_hash=?", [uri, source_hash]
        with self._conn() as c:
            row = c.execute(q, args).fetchone()
        return row[0] if row else None

    def add_bench_run(self, record: dict) -> int:
        """Store one ``mlagen bench`` run's record (JSON-serializable); returns its row id."""
        with self._conn() as c:
            cur = c.execute("INSERT INTO bench_runs (at, record_json) VALUES (?, ?)", (time.time(), json.dumps(record)))
            return int(cur.lastrowid)

