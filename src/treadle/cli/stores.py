"""`treadle sessions --store URL` and `treadle show store:KEY`: conversation stores on the
command line.

`sessions --store URL` lists the store's conversations and its pending passes; with `--import`
it imports JSONL session files (each as a new conversation; `--skip-existing` leaves out those
whose key the store has, so a stopped import can run again), with `--export DIR` it writes every
conversation as a JSONL file. `show store:KEY` renders one stored conversation like a session
file. The store comes from `--store`, else `TREADLE_STORE`, else `.treadle/treadle.db`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

from treadle.cli.console import Console
from treadle.cli.failures import EXIT_CODES, CliFailure
from treadle.cli.show import TranscriptView
from treadle.errors import ConfigurationError, ConflictError, PersistenceError, StoreError
from treadle.stores import DEFAULT_SQLITE_PATH, Store

__all__ = ["STORE_ENV", "open_cli_store", "show_stored", "store_sessions_command"]

#: The environment variable naming the store when `--store` is not given.
STORE_ENV = "TREADLE_STORE"

#: How `treadle show` names a stored conversation instead of a file.
STORE_PREFIX = "store:"


def open_cli_store(url: str | None) -> Store:
    """The store named by `url`, `TREADLE_STORE` or the default SQLite file."""
    return Store.open(url or os.environ.get(STORE_ENV) or DEFAULT_SQLITE_PATH)


#: Longest file name an export writes (bytes; most file systems allow 255).
MAX_EXPORT_NAME_BYTES = 200


def export_file_name(key: str) -> str:
    """The file name an export gives conversation `key`: the key quoted (keys may hold any
    character), or, when that is too long for a file name, its start and a hash of the key."""
    name = quote(key, safe="")
    if len(name.encode()) + len(".jsonl") <= MAX_EXPORT_NAME_BYTES:
        return f"{name}.jsonl"
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return f"{name[:120].rstrip('%')}-{digest}.jsonl"


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).isoformat(sep=" ", timespec="seconds")


def store_sessions_command(
    url: str | None,
    console: Console,
    *,
    as_json: bool = False,
    imports: Sequence[Path] = (),
    export: Path | None = None,
    skip_existing: bool = False,
) -> int:
    """Run `treadle sessions --store URL`; returns the exit code."""
    with open_cli_store(url) as store:
        _import_files(store, console, imports, skip_existing=skip_existing)
        infos = store.conversations()
        if export is not None:
            failed = []
            for info in infos:
                try:
                    target = store.export_jsonl(info.key, export / export_file_name(info.key))
                except (OSError, StoreError, ConfigurationError) as err:
                    failed.append(info.key)  # one key that cannot be written stops no other
                    console.line(f"could not export {info.key!r}: {err}")
                    continue
                console.line(f"exported {info.key} to {target}")
            if failed:
                raise CliFailure(
                    f"{len(failed)} conversation(s) were not exported (see above).",
                    "",
                    EXIT_CODES["usage"],
                )
        pending = store.pending()
        if as_json:
            console.line(
                json.dumps(
                    {
                        "store": store.url,
                        "conversations": [
                            {"key": i.key, "version": i.version, "updated_at": i.updated_at,
                             "parent_key": i.parent_key}
                            for i in infos
                        ],
                        "pending": [
                            {"pass_id": p.pass_id, "key": p.key, "status": p.status,
                             "version": p.version,
                             "approvals": [a.get("name") for a in p.pending_approvals]}
                            for p in pending
                        ],
                    },
                    indent=2,
                )
            )  # fmt: skip
            return EXIT_CODES["ok"]
        if not infos:
            console.line(f"No conversations in {store.url}.")
            return EXIT_CODES["ok"]
        console.table(
            ["key", "version", "updated", "forked from"],
            [[i.key, str(i.version), _when(i.updated_at), i.parent_key or "-"] for i in infos],
        )
        if pending:
            console.line("")
            console.table(
                ["pending pass", "key", "status", "waiting for"],
                [
                    [p.pass_id, p.key, p.status,
                     ", ".join(str(a.get("name")) for a in p.pending_approvals) or "-"]
                    for p in pending
                ],
            )  # fmt: skip
    return EXIT_CODES["ok"]


def _import_files(
    store: Store, console: Console, imports: Sequence[Path], *, skip_existing: bool
) -> None:
    """`--import`: each file (or each `.jsonl` of a directory, in name order) as a new
    conversation. The first file that fails stops the import (each file is its own transaction:
    the ones before it stay imported); its error says how to go on. With `skip_existing` a file
    whose key the store already has (whatever its row count) is left out instead, so a stopped
    import can be run again, and a file the store refuses (unreadable, or its session id is no
    usable key) is reported and the import goes on: the command then fails once every other
    file is in."""
    imported = 0
    refused = 0
    for path in imports:
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        for file in files:
            try:
                key, version = store.import_jsonl(file)
            except ConflictError as err:  # the key exists
                if skip_existing:
                    console.line(f"skipped {file}: {err}")
                    continue
                raise CliFailure(
                    f"{file} was not imported: {err} {imported} file(s) were imported before "
                    "it; run the same command again with --skip-existing to import the rest "
                    "(files whose key the store already has are left out).",
                    "",
                    EXIT_CODES["usage"],
                ) from None
            except (PersistenceError, ConfigurationError) as err:  # this file, not the store
                if skip_existing:
                    refused += 1
                    console.line(f"refused {file}: {err}", "warn")
                    continue
                raise CliFailure(
                    f"{file} was not imported: {err} {imported} file(s) were imported before "
                    "it; fix or move the file, then run the same command again with "
                    "--skip-existing (files already imported are left out, files refused are "
                    "reported).",
                    "",
                    EXIT_CODES["usage"],
                ) from None
            imported += 1
            console.line(f"imported {file} as {key} ({version} rows)")
    if refused:
        raise CliFailure(
            f"{refused} file(s) were not imported (see above); {imported} file(s) were.",
            "fix or move those files, then run the same command again with --skip-existing.",
            EXIT_CODES["usage"],
        )


def show_stored(target: str, url: str | None, console: Console) -> int:
    """Run `treadle show store:KEY`; returns the exit code."""
    key = target.removeprefix(STORE_PREFIX)
    with open_cli_store(url) as store:
        convo = store.conversation(key)
        rows = convo.rows
        if not rows:
            raise CliFailure(
                f"No conversation {key!r} in {store.url}.",
                "list them with `treadle sessions --store URL`.",
                EXIT_CODES["usage"],
            )
        view = TranscriptView(console)
        view.header({"session_id": f"{key} (version {len(rows)}, {store.url})"})
        for row in rows:
            view.row(row)
        for call in convo.pending_approvals:
            console.line(f"waiting for approval: {call.get('name')} ({call.get('id')})", "warn")
        view.end(closed=True, stop_reason=convo.stop_reason, usage=convo.usage)
    return EXIT_CODES["ok"]
