"""Treadle's benchmark suite: Treadle against hand-written reference loops, in one run.

Run it with `make bench` (full, a few minutes) or `make bench-quick` (under a minute); see
docs/performance.md. Timing lives here and never in the unit tests. Nothing in this package is
imported by the library.
"""
