"""Persistence: JSONL session files written during a pass and loaded back for resume."""

from treadle.persist.format import SCHEMA_VERSION
from treadle.persist.reader import LoadedSession, load_session
from treadle.persist.writer import SessionWriter, default_session_path

__all__ = [
    "SCHEMA_VERSION",
    "LoadedSession",
    "SessionWriter",
    "default_session_path",
    "load_session",
]
