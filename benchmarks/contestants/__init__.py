"""Treadle as a benchmark contestant (through its public API only)."""
