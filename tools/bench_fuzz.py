"""The fuzz figures for BENCHMARKS.md: tools/fuzz.py at 5,000 cases per kind of file."""

from fuzz import run

__all__ = ["run"]
