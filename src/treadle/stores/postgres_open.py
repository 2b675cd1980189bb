"""Opening a PostgreSQL store: the DSN checked, one first connection (whose error says what
failed), the schema created or migrated under an advisory lock, then the pool.

The pool runs on the Treadle runtime's loop (it belongs to the loop that opens it); `connect`
opens the connections of a calling loop's own pool (`treadle.stores.postgres_loops`).
"""

from __future__ import annotations

import asyncio
import select
from typing import TYPE_CHECKING, Any

from treadle.errors import ConfigurationError
from treadle.stores.backend import SCHEMA_VERSION, schema_found

if TYPE_CHECKING:
    from psycopg import AsyncConnection
    from psycopg_pool import AsyncConnectionPool

__all__ = [
    "CONNECT_OPTIONS", "DB_NOW", "MIGRATIONS", "connect", "display_url", "open_pool", "prepare",
]  # fmt: skip

#: What every connection of the store is opened with. The client encoding is UTF8 whatever the
#: database, PGCLIENTENCODING or the DSN (`client_encoding`, `options=-c ...`) say: a large
#: batch is encoded to UTF-8 bytes off the loop (`postgres_batch.DumpedJson`),
#: and the server must read them as such; UTF8 also carries any text to any database that can
#: store it. A startup parameter overrides the DSN's and the environment's.
CONNECT_OPTIONS: dict[str, Any] = {"autocommit": True, "client_encoding": "UTF8"}

#: The database server's clock, in seconds since the epoch (what owner leases are timed by).
DB_NOW = "extract(epoch FROM clock_timestamp())::float8"

#: A pass's commit as one server-side call (one round trip, one transaction): take the
#: conversation's lock, check the version (a conflict returns -1 - the version found, and marks
#: the pass), append the rows, move the head, settle the pass. Version 1 as first shipped; see
#: `COMMIT_FUNCTION` for the one in use.
_COMMIT_FUNCTION_1 = """
CREATE FUNCTION treadle_commit(
    p_pass TEXT, p_key TEXT, p_base BIGINT, p_kinds TEXT[], p_payloads TEXT[], p_usage TEXT,
    p_stop TEXT, p_meta TEXT, p_status TEXT, p_agents TEXT, p_recorded BOOLEAN,
    p_now DOUBLE PRECISION
) RETURNS BIGINT LANGUAGE plpgsql AS $$
DECLARE
    found BIGINT;
    target BIGINT := p_base + cardinality(p_kinds);
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, 0));
    SELECT version INTO found FROM treadle_conversations WHERE key = p_key;
    IF coalesce(found, 0) <> p_base THEN
        UPDATE treadle_passes SET status = 'conflict', updated_at = p_now WHERE pass_id = p_pass;
        RETURN -1 - coalesce(found, 0);
    END IF;
    INSERT INTO treadle_rows (key, seq, pass_id, kind, payload)
        SELECT p_key, p_base + t.o - 1, p_pass, t.k, t.p
        FROM unnest(p_kinds, p_payloads) WITH ORDINALITY AS t(k, p, o);
    IF found IS NULL THEN
        INSERT INTO treadle_conversations (key, version, usage, stop_reason, metadata,
            created_at, updated_at) VALUES (p_key, target, p_usage, p_stop, p_meta, p_now, p_now);
    ELSE
        UPDATE treadle_conversations SET version = target, usage = p_usage, stop_reason = p_stop,
            metadata = p_meta, updated_at = p_now WHERE key = p_key;
    END IF;
    IF p_recorded OR p_status <> 'done' THEN
        INSERT INTO treadle_passes (pass_id, key, status, version, agent_rows, metadata,
            created_at, updated_at) VALUES (p_pass, p_key, p_status, target, p_agents, p_meta,
            p_now, p_now)
        ON CONFLICT (pass_id) DO UPDATE SET status = p_status, version = target,
            metadata = p_meta, updated_at = p_now;
        DELETE FROM treadle_journal WHERE pass_id = p_pass;
    END IF;
    RETURN target;
END
$$"""

#: The commit of schema version 2. The head row is locked (`FOR UPDATE`) before the version
#: check, and moved before any row is written: a delete or prune that got to the head first
#: (holding its row lock, or the conversation's advisory lock as they now take) is waited for,
#: and the pass then finds the conversation gone and conflicts instead of writing rows that no
#: head points to. A head that moves no row (it vanished anyway) is a conflict too. A new head
#: first clears rows an older release may have left without one, so such a key works again.
_COMMIT_FUNCTION_2 = """
CREATE OR REPLACE FUNCTION treadle_commit(
    p_pass TEXT, p_key TEXT, p_base BIGINT, p_kinds TEXT[], p_payloads TEXT[], p_usage TEXT,
    p_stop TEXT, p_meta TEXT, p_status TEXT, p_agents TEXT, p_recorded BOOLEAN,
    p_now DOUBLE PRECISION
) RETURNS BIGINT LANGUAGE plpgsql AS $$
DECLARE
    head BIGINT;
    target BIGINT := p_base + cardinality(p_kinds);
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, 0));
    SELECT version INTO head FROM treadle_conversations WHERE key = p_key FOR UPDATE;
    IF coalesce(head, 0) <> p_base THEN
        UPDATE treadle_passes SET status = 'conflict', updated_at = p_now WHERE pass_id = p_pass;
        RETURN -1 - coalesce(head, 0);
    END IF;
    IF head IS NULL THEN
        DELETE FROM treadle_rows WHERE key = p_key;
        INSERT INTO treadle_conversations (key, version, usage, stop_reason, metadata,
            created_at, updated_at) VALUES (p_key, target, p_usage, p_stop, p_meta, p_now, p_now);
    ELSE
        UPDATE treadle_conversations SET version = target, usage = p_usage, stop_reason = p_stop,
            metadata = p_meta, updated_at = p_now WHERE key = p_key AND version = p_base;
        IF NOT FOUND THEN
            UPDATE treadle_passes SET status = 'conflict', updated_at = p_now
                WHERE pass_id = p_pass;
            RETURN -1;
        END IF;
    END IF;
    INSERT INTO treadle_rows (key, seq, pass_id, kind, payload)
        SELECT p_key, p_base + t.o - 1, p_pass, t.k, t.p
        FROM unnest(p_kinds, p_payloads) WITH ORDINALITY AS t(k, p, o);
    IF p_recorded OR p_status <> 'done' THEN
        INSERT INTO treadle_passes (pass_id, key, status, version, agent_rows, metadata,
            created_at, updated_at) VALUES (p_pass, p_key, p_status, target, p_agents, p_meta,
            p_now, p_now)
        ON CONFLICT (pass_id) DO UPDATE SET status = p_status, version = target,
            metadata = p_meta, updated_at = p_now;
        DELETE FROM treadle_journal WHERE pass_id = p_pass;
    END IF;
    RETURN target;
END
$$"""

#: The commit in use (schema version 3): version 2's, which also checks that the conversation
#: is the one the pass read (`p_born`, its `created_at` then; 0: there was none; NULL: not
#: checked), in the head's own `SELECT`: a key deleted and started again may be back at the
#: pass's version (ABA). A recorded pass that read the conversation (`p_recorded`, `p_born`)
#: settles its record before any row is written, and conflicts when the record is gone: a
#: delete or prune took it with its conversation while the pass ran. (A new overload: version
#: 2's stays for processes of the release before, which refuse this schema at their next start.)
COMMIT_FUNCTION = """
CREATE OR REPLACE FUNCTION treadle_commit(
    p_pass TEXT, p_key TEXT, p_base BIGINT, p_kinds TEXT[], p_payloads TEXT[], p_usage TEXT,
    p_stop TEXT, p_meta TEXT, p_status TEXT, p_agents TEXT, p_recorded BOOLEAN,
    p_now DOUBLE PRECISION, p_born DOUBLE PRECISION
) RETURNS BIGINT LANGUAGE plpgsql AS $$
DECLARE
    head BIGINT;
    born DOUBLE PRECISION;
    target BIGINT := p_base + cardinality(p_kinds);
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, 0));
    SELECT version, created_at INTO head, born FROM treadle_conversations WHERE key = p_key
        FOR UPDATE;
    IF coalesce(head, 0) <> p_base OR (p_born IS NOT NULL AND coalesce(born, 0) <> p_born) THEN
        UPDATE treadle_passes SET status = 'conflict', updated_at = p_now WHERE pass_id = p_pass;
        RETURN -1 - coalesce(head, 0);
    END IF;
    IF p_recorded AND p_born IS NOT NULL THEN
        UPDATE treadle_passes SET status = p_status, version = target, metadata = p_meta,
            updated_at = p_now WHERE pass_id = p_pass;
        IF NOT FOUND THEN
            RETURN -1 - coalesce(head, 0);
        END IF;
        DELETE FROM treadle_journal WHERE pass_id = p_pass;
    ELSIF p_recorded OR p_status <> 'done' THEN
        INSERT INTO treadle_passes (pass_id, key, status, version, agent_rows, metadata,
            created_at, updated_at) VALUES (p_pass, p_key, p_status, target, p_agents, p_meta,
            p_now, p_now)
        ON CONFLICT (pass_id) DO UPDATE SET status = p_status, version = target,
            metadata = p_meta, updated_at = p_now;
        DELETE FROM treadle_journal WHERE pass_id = p_pass;
    END IF;
    IF head IS NULL THEN
        DELETE FROM treadle_rows WHERE key = p_key;
        INSERT INTO treadle_conversations (key, version, usage, stop_reason, metadata,
            created_at, updated_at) VALUES (p_key, target, p_usage, p_stop, p_meta, p_now, p_now);
    ELSE
        UPDATE treadle_conversations SET version = target, usage = p_usage, stop_reason = p_stop,
            metadata = p_meta, updated_at = p_now WHERE key = p_key AND version = p_base;
        IF NOT FOUND THEN
            UPDATE treadle_passes SET status = 'conflict', updated_at = p_now
                WHERE pass_id = p_pass;
            RETURN -1;
        END IF;
    END IF;
    INSERT INTO treadle_rows (key, seq, pass_id, kind, payload)
        SELECT p_key, p_base + t.o - 1, p_pass, t.k, t.p
        FROM unnest(p_kinds, p_payloads) WITH ORDINALITY AS t(k, p, o);
    RETURN target;
END
$$"""

#: Schema migrations, by the version they reach; each runs once, in one transaction.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE treadle_conversations (
            key TEXT PRIMARY KEY, version BIGINT NOT NULL, usage TEXT NOT NULL,
            stop_reason TEXT, metadata TEXT NOT NULL, parent_key TEXT, parent_version BIGINT,
            created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL)""",
        """CREATE TABLE treadle_rows (
            key TEXT NOT NULL, seq BIGINT NOT NULL, pass_id TEXT, kind TEXT NOT NULL,
            payload TEXT NOT NULL, PRIMARY KEY (key, seq))""",
        """CREATE TABLE treadle_passes (
            pass_id TEXT PRIMARY KEY, key TEXT NOT NULL, status TEXT NOT NULL,
            version BIGINT NOT NULL, agent_rows TEXT NOT NULL, metadata TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL)""",
        "CREATE INDEX treadle_passes_by_key ON treadle_passes (key, status)",
        """CREATE TABLE treadle_journal (
            pass_id TEXT NOT NULL, seq BIGINT NOT NULL, entry TEXT NOT NULL, kind TEXT NOT NULL,
            body TEXT NOT NULL, PRIMARY KEY (pass_id, seq))""",
        _COMMIT_FUNCTION_1,
    ),
    2: (_COMMIT_FUNCTION_2,),
    3: (COMMIT_FUNCTION,),
}
assert max(MIGRATIONS) == SCHEMA_VERSION

#: The advisory lock key that serialises schema migrations across processes.
_MIGRATION_LOCK = 0x7472_6561_646C


def display_url(dsn: str) -> str:
    """`postgresql://user@host:port/dbname` (no password) from a DSN, or ConfigurationError."""
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        raise ConfigurationError(
            "Store.postgres needs psycopg; install it with pip install 'treadle[postgres]'."
        ) from None
    try:
        parts = conninfo_to_dict(dsn)
    except Exception as err:  # psycopg.ProgrammingError: the DSN does not parse
        raise ConfigurationError(f"the PostgreSQL DSN does not parse: {err}.") from None
    user = f"{parts['user']}@" if parts.get("user") else ""
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{user}{parts.get('host', '')}{port}/{parts.get('dbname', '')}"


async def open_pool(
    dsn: str, url: str, pool_size: int, connect_seconds: float, *, prepared: bool = False
) -> AsyncConnectionPool[AsyncConnection[Any]]:
    """Connect once (a clear error if that fails), create or migrate the schema, open the pool.
    `prepared`: the store has connected before (a loop's own pool did): the pool opens without
    waiting for its first connection, so a server refusing connections now makes its callers
    wait (up to the pool's timeout) instead of failing fast."""
    from psycopg_pool import AsyncConnectionPool

    if not prepared:
        await prepare(dsn, url, connect_seconds)
    pool: AsyncConnectionPool[AsyncConnection[Any]] = AsyncConnectionPool(
        dsn,
        min_size=1,
        max_size=pool_size,
        kwargs=dict(CONNECT_OPTIONS),
        timeout=max(connect_seconds, 30.0),
        open=False,
    )
    await pool.open(wait=not prepared, timeout=connect_seconds)
    return pool


def alive(conn: AsyncConnection[Any]) -> bool:
    """Whether an idle connection is still up, without a round trip: a server that ends a
    connection (a restart, `pg_terminate_backend`) says so on its socket and closes it, so an
    idle connection with anything to read is one the server has ended (or, rarely, one that got
    a notice: it is opened again, a reconnect at most). One `poll` with no wait."""
    if conn.closed or conn.broken:
        return False
    try:
        poller = select.poll()  # not select.select: it refuses descriptors past 1023
        poller.register(conn.pgconn.socket, select.POLLIN)
        return not poller.poll(0)
    except Exception:  # OSError, psycopg's: the connection is gone
        return False


async def connect(dsn: str, connect_seconds: float) -> AsyncConnection[Any]:
    """One connection of the store (`CONNECT_OPTIONS`), within `connect_seconds`; an error
    says what failed (a `psycopg.OperationalError`)."""
    import psycopg

    try:
        return await asyncio.wait_for(
            psycopg.AsyncConnection.connect(
                dsn, connect_timeout=max(1, int(connect_seconds)), **CONNECT_OPTIONS
            ),
            connect_seconds,
        )
    except TimeoutError:
        raise psycopg.OperationalError("no answer within the connect timeout") from None


async def prepare(dsn: str, url: str, connect_seconds: float) -> None:
    """Connect once (a clear `ConfigurationError` if that fails) and create or migrate the
    schema (under an advisory lock: several processes, or loops, may start at once)."""
    import psycopg

    timeout = connect_seconds
    try:  # one plain connection first: its error says what failed (the pool's would not)
        conn = await asyncio.wait_for(
            psycopg.AsyncConnection.connect(
                dsn, connect_timeout=max(1, int(timeout)), **CONNECT_OPTIONS
            ),
            timeout,
        )
    except (psycopg.Error, OSError, TimeoutError) as err:
        what = " ".join(str(err).split()) or "no answer within the timeout"
        raise ConfigurationError(
            f"cannot connect to the PostgreSQL store {url}: {what}; check the DSN "
            "and that the server is running."
        ) from None
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS treadle_schema (version INTEGER NOT NULL)"
            )
            cur = await conn.execute("SELECT max(version) FROM treadle_schema")
            found = schema_found(((await cur.fetchone()) or (None,))[0], f"the database {url}")
            for version in sorted(v for v in MIGRATIONS if v > found):
                for statement in MIGRATIONS[version]:
                    await conn.execute(statement)
                await conn.execute("INSERT INTO treadle_schema VALUES (%s)", (version,))
    finally:
        await conn.close()
