"""Shared fixtures. Tests talk to real parts: the runtime thread, real files, real subprocesses."""

from __future__ import annotations
