"""The cluster-wide KV directory (paper 4.3, Appendix A.3, Algorithms E.1 and E.2)."""

from evinfra.directory.branches import BranchStep, BranchTable
from evinfra.directory.carryover import Answer, CarryIndex, Carried
from evinfra.directory.chains import ChainIndex, Inferred
from evinfra.directory.directory import Directory
from evinfra.directory.eviction import HostEvictionOrder, eviction_order
from evinfra.directory.tree import PrefixMatch, PrefixTree, TreeStats

__all__ = [
    "Answer",
    "BranchStep",
    "BranchTable",
    "Carried",
    "CarryIndex",
    "ChainIndex",
    "Directory",
    "HostEvictionOrder",
    "Inferred",
    "PrefixMatch",
    "PrefixTree",
    "TreeStats",
    "eviction_order",
]
