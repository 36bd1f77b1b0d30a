"""Online phase-split adaptation (paper 5.1, 5.2, Algorithm E.3 outer loop); see README.md."""

from evinfra.planner.itermodel import FitReport, NodeFitter, NodeModel, PrefillMix, phi, pool
from evinfra.planner.planner import (Candidate, Decision, Planner, PlannerConfig, Split,
                                     plan)
from evinfra.planner.window import SliceWork, Window

__all__ = [
    "Candidate",
    "Decision",
    "FitReport",
    "NodeFitter",
    "NodeModel",
    "Planner",
    "PlannerConfig",
    "PrefillMix",
    "SliceWork",
    "Split",
    "Window",
    "phi",
    "plan",
    "pool",
]
