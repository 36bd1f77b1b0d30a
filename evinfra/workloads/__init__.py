"""Agent workloads: the agent model, generators, trace readers and the runner (see README.md)."""

from evinfra.workloads.agentic import read_agentic
from evinfra.workloads.arrivals import Arrival, Phase, poisson_arrivals
from evinfra.workloads.backend import AgentRequest, Backend, Outcome, RequestRecord
from evinfra.workloads.cc import CC
from evinfra.workloads.osworld import OSWorld
from evinfra.workloads.program import (
    Agent, Call, Compact, Fork, Join, Op, Pause, Program, Reset, Spawn, Workload,
)
from evinfra.workloads.putnam import Putnam
from evinfra.workloads.registry import GENERATORS, TRACE_FORMATS, make_workload, read_trace
from evinfra.workloads.reuse import IdealCache
from evinfra.workloads.runner import Runner, RunnerStats
from evinfra.workloads.shift import PAPER_SHIFT, paper_shift, schedule_from_data
from evinfra.workloads.tokens import TokenSpace, block_tokens, stable_seed, synth
from evinfra.workloads.traces import TraceWorkload, read_mooncake, read_trie

__all__ = [
    "Agent",
    "AgentRequest",
    "Arrival",
    "Backend",
    "CC",
    "Call",
    "Compact",
    "Fork",
    "GENERATORS",
    "IdealCache",
    "Join",
    "OSWorld",
    "Op",
    "Outcome",
    "PAPER_SHIFT",
    "Pause",
    "Phase",
    "Program",
    "Putnam",
    "RequestRecord",
    "Reset",
    "Runner",
    "RunnerStats",
    "Spawn",
    "TRACE_FORMATS",
    "TokenSpace",
    "TraceWorkload",
    "Workload",
    "block_tokens",
    "make_workload",
    "paper_shift",
    "poisson_arrivals",
    "read_agentic",
    "read_mooncake",
    "read_trace",
    "read_trie",
    "schedule_from_data",
    "stable_seed",
    "synth",
]
