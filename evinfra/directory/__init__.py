"""The cluster-wide KV directory (paper 4.3, Appendix A.3, Algorithms E.1 and E.2)."""

from evinfra.directory.branches import BranchStep, BranchTable
from evinfra.directory.directory import Directory
from evinfra.directory.eviction import HostEvictionOrder, eviction_order
from evinfra.directory.tree import PrefixMatch, PrefixTree, TreeStats

__all__ = [
    "BranchStep",
    "BranchTable",
    "Directory",
    "HostEvictionOrder",
    "PrefixMatch",
    "PrefixTree",
    "TreeStats",
    "eviction_order",
]
