"""Hierarchical partitions (paper D.2): serve behind nginx, simulate partitions in parallel.
Import from the modules (README.md)."""
