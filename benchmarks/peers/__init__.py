"""Peer frameworks run through the same workloads, each in its own venv (see setup.sh).

A peer is skipped with a message when `benchmarks/.peers/<name>/` is absent.
"""
