"""Where a study lives: storage URLs checked without creating anything, opened (SQLite in WAL mode,
PostgreSQL with its schema created under a lock), servers that must answer before a model loads,
and the lock that makes "budget left? → plan → ask" atomic among drivers sharing one study.

URLs: any SQLAlchemy URL (``sqlite:///autotune.db`` is the embedded default,
``postgresql+psycopg://...`` for several drivers or hosts sharing one study); ``journal:PATH`` for
an Optuna journal file; ``memory`` for an in-process study that is gone when the command ends.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from autotune.errors import InputError


@dataclass(frozen=True)
class StorageSpec:
    url: str
    kind: str  # rdb | journal | memory
    path: Path | None = None  # the local file, for sqlite and journal storages

    def exists(self) -> bool:
        return self.kind != "memory" and (self.path is None or self.path.exists())


def parse_storage(url: str, flag: str = "--storage") -> StorageSpec:
    """Check a storage URL without creating anything."""
    if url == "memory":
        return StorageSpec(url, "memory")
    if url.startswith("journal:"):
        raw = url[len("journal:"):]
        raw = raw[2:] if raw.startswith("///") else raw  # journal:///abs/path → /abs/path
        if not raw:
            raise InputError(flag, None, "journal storage needs a file: journal:PATH", url)
        path = Path(raw).resolve()
        _check_parent(flag, url, path)
        return StorageSpec(url, "journal", path)
    if "://" not in url:
        raise InputError(flag, None, "must be a SQLAlchemy URL (sqlite:///FILE, postgresql+psycopg://...), "
                         "journal:FILE or memory", url)
    scheme = url.split("://", 1)[0]
    if scheme == "sqlite":
        raw = url[len("sqlite:///"):] if url.startswith("sqlite:///") else ""
        if not raw or raw == ":memory:":
            raise InputError(flag, None, "sqlite storage needs a file (sqlite:///FILE); use `memory` for an "
                             "in-process study", url)
        path = Path(raw).resolve()
        _check_parent(flag, url, path)
        return StorageSpec(url, "rdb", path)
    import sqlalchemy

    try:
        sqlalchemy.engine.make_url(url).get_dialect()
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ImportError) as exc:
        raise InputError(flag, None, f"must be a storage URL this installation can open ({exc})", url) from None
    return StorageSpec(url, "rdb")


REACH_TIMEOUT_S = 5.0  # a storage or tracking server must answer this fast before a model loads


def reach_storage(spec: StorageSpec, flag: str = "--storage", timeout_s: float = REACH_TIMEOUT_S) -> None:
    """A database storage (PostgreSQL, MySQL) answers within ``timeout_s``: checked before the model
    loads, so an unreachable server is a message in seconds, not a traceback after the loading."""
    if spec.kind != "rdb" or spec.url.startswith("sqlite"):
        return
    import sqlalchemy

    def connect() -> None:
        engine = sqlalchemy.create_engine(spec.url, poolclass=sqlalchemy.pool.NullPool)
        try:
            engine.connect().close()
        finally:
            engine.dispose()

    error = answer_within(connect, timeout_s)
    if error is not None:
        raise InputError(flag, None, f"the storage does not answer ({error})", spec.url)


def answer_within(fn: Callable[[], None], timeout_s: float) -> str | None:
    """Runs ``fn`` in a daemon thread; None when it returned in time, else why not (bounded text)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except Exception as exc:  # any driver's error: reported, not raised
            outcome.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if not outcome:
        return f"no answer within {timeout_s:g} s"
    exc = outcome[0]
    if exc is None:
        return None
    first_line = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line[:200]}"


def _check_parent(flag: str, url: str, path: Path) -> None:
    if not path.parent.is_dir():
        raise InputError(flag, None, "the folder of the storage file must exist", url)


def open_storage(spec: StorageSpec, *, create: bool) -> optuna.storages.BaseStorage:
    """Open (``create=True``: create if needed) a storage. Reading commands pass ``create=False``
    and get an :class:`InputError` instead of a new empty database."""
    if not create and not spec.exists():
        raise InputError("--storage", None, "no study storage there (run `autotune sweep` first)", spec.url)
    if spec.kind == "memory":  # lives as long as the returned object: one command, or one API call
        return optuna.storages.InMemoryStorage()
    if spec.kind == "journal":
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(str(spec.path)))
    if is_postgres(spec):  # drivers starting together on an empty database would both create the schema
        with BudgetLock(spec, "schema") as lock:
            storage = optuna.storages.RDBStorage(spec.url)
        lock.close()
        return storage
    storage = optuna.storages.RDBStorage(spec.url)
    if spec.url.startswith("sqlite"):
        _fast_sqlite_commits(storage)
    return storage


def _fast_sqlite_commits(storage: optuna.storages.RDBStorage) -> None:
    """Write-ahead log with ``synchronous=NORMAL``: a commit no longer waits for an fsync.

    The driver writes each trial attribute in a transaction of its own (≈40 per trial); with the
    default rollback journal each costs ~10 ms of fsync, which is most of the driver's time per
    trial on small models. In WAL mode a crash of the driver loses nothing; only a power cut can
    lose the last commits (the database stays consistent).
    """
    import sqlalchemy

    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    sqlalchemy.event.listen(storage.engine, "connect", on_connect)
    storage.engine.dispose()  # connections opened while the storage was set up reconnect with the pragmas


def is_postgres(spec: StorageSpec) -> bool:
    return spec.kind == "rdb" and spec.url.startswith("postgresql")


def load_existing(storage: optuna.storages.BaseStorage, name: str) -> optuna.Study:
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    if name not in names:
        raise InputError("STUDY", None, f"no such study in this storage; studies there are {sorted(names)}", name)
    return optuna.load_study(study_name=name, storage=storage)


class BudgetLock:
    """Makes "is budget left? → plan → ask" atomic among drivers that share one study.

    PostgreSQL: a session-level advisory lock keyed by the study name, on a connection of its own;
    the server frees it when a driver dies. Other storages serve one driver per study (SQLite and
    journal files are not meant for several hosts), so the lock only orders this process's threads.
    """

    def __init__(self, spec: StorageSpec, study_name: str) -> None:
        self._thread_lock = threading.Lock()
        self._engine: Any = None
        self._conn: Any = None
        digest = hashlib.sha256(f"autotune:{study_name}".encode()).digest()
        self._key = int.from_bytes(digest[:8], "big", signed=True)
        if is_postgres(spec):
            import sqlalchemy

            self._engine = sqlalchemy.create_engine(spec.url, poolclass=sqlalchemy.pool.NullPool)

    def __enter__(self) -> BudgetLock:
        self._thread_lock.acquire()
        if self._engine is not None:
            import sqlalchemy

            try:
                if self._conn is None:
                    self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
                self._conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": self._key})
            except BaseException:
                self._thread_lock.release()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._conn is not None:
                import sqlalchemy

                self._conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": self._key})
        finally:
            self._thread_lock.release()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._engine is not None:
            self._engine.dispose()
