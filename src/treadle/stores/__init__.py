"""Conversation stores: conversations that outlive the process, by key, in SQLite (the default,
standard library) or PostgreSQL (the `treadle[postgres]` extra, imported only when used)."""

from treadle.stores.backend import SCHEMA_VERSION, StoreBackend
from treadle.stores.journal import ConversationJournal
from treadle.stores.opening import ConversationStart, open_conversation
from treadle.stores.queueing import OnConflict
from treadle.stores.records import ConversationInfo, PendingPass, StoredConversation
from treadle.stores.store import DEFAULT_SQLITE_PATH, Store, check_store_arguments, store_options

__all__ = [
    "DEFAULT_SQLITE_PATH",
    "SCHEMA_VERSION",
    "ConversationInfo",
    "ConversationJournal",
    "ConversationStart",
    "OnConflict",
    "PendingPass",
    "Store",
    "StoreBackend",
    "StoredConversation",
    "check_store_arguments",
    "open_conversation",
    "store_options",
]
