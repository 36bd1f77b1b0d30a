"""The service's side of agent branches: the branches of requests without hints, and the ends
of branches that no harness reports.

* **Inference** (:meth:`BranchKeeper.infer`): a request without a branch hint gets the branch
  its prompt tells (``chains.py``: the tip it extends; ``carryover.py``: the earlier answers
  it takes in), or a branch of one.
* **Ends** (:meth:`BranchKeeper.end`, E.2 line 13 on the harness's behalf): a branch whose
  last answer a parent took in (a sub-agent's report), one idle past its limit
  (``server.branch_idle_s`` for named branches, ``server.inferred_branch_idle_s`` for
  inferred ones), or one its harness ended while requests of it ran (ended after them).

A branch with requests in flight (the :class:`~evinfra.control.ledger.Ledger` counts them)
is never idle.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import structlog

from evinfra.config import ServerConfig
from evinfra.control.carryover import Answer, CarryIndex
from evinfra.control.chains import ChainIndex
from evinfra.control.counters import Counters
from evinfra.control.ledger import Flight, Ledger
from evinfra.core.types import BranchId, RequestId
from evinfra.directory import Directory

__all__ = ["BranchKeeper", "Inference"]

log = structlog.get_logger(__name__)


class Inference(NamedTuple):
    """A request's branch as its hints or its prompt tell it (:meth:`BranchKeeper.infer`)."""

    branch: BranchId
    parent: BranchId | None
    final: bool
    tip: int | None = None
    """The key its prompt leaves for the next one to extend (None: no inference)."""
    answer: Answer | None = None
    """Where its answer's fingerprints collect, if its branch lives on after it."""
    joined: Sequence[BranchId] = ()
    """Sub-agents whose reports its prompt takes in: they are over."""
    compacts: bool = False
    """It restarts its branch from a summary (a rewrite)."""


class BranchKeeper:
    def __init__(self, server: ServerConfig, page_size: int, directory: Directory,
                 ledger: Ledger, counters: Counters) -> None:
        self.server = server
        self.directory = directory
        self.ledger = ledger
        self.counters = counters
        self.chains = ChainIndex(page_size) if server.infer_branches else None
        self.carry = CarryIndex()
        # Branches by the time they were last active, least recent first: named ones
        # (``server.branch_idle_s``) and inferred ones (``server.inferred_branch_idle_s``).
        self._idle_since: dict[BranchId, float] = {}
        self._inferred_idle_since: dict[BranchId, float] = {}

    def inferred(self) -> int:
        """Live inferred branches."""
        return len(self.chains) if self.chains is not None else 0

    # -- inference -------------------------------------------------------------------------

    def infer(self, rid: RequestId, tokens: np.ndarray, parent: BranchId | None,
              final: bool) -> Inference:
        """The branch of a request without one (see :mod:`evinfra.control.chains` and
        :mod:`evinfra.control.carryover`), first that applies:

        - the live inferred branch whose latest tip its prompt extends;
        - the idle branch whose last answer its prompt holds after the same first page,
          past the tip it extends if any (a compaction, or a context edited after an
          earlier turn): that branch goes on, rewritten;
        - a fork of the live branch whose earlier tip it extends;
        - a new branch if it extends some other tip, a branch of one if none.

        A prompt that extends a tip and takes in other idle branches' last answers
        (sub-agents' reports) ends those branches. A request that names a parent, or ends
        its branch, is a branch of one, as is any without inference."""
        one = f"~{rid}"
        if self.chains is None or parent is not None or final:
            return Inference(one, parent, True)
        keys = self.chains.keys(tokens)
        tip = self.chains.tip(keys, int(tokens.size))
        if tip is None:
            return Inference(one, None, True)
        found = self.chains.find(keys, self.directory)
        carried = self.carry.find(tokens, found.pages * self.chains.page_size, keys[0],
                                  (found.continues,))
        answer = Answer(keys[0])
        if found.continues is not None:
            return Inference(found.continues, None, False, tip, answer, carried.branches)
        for branch, same_start in zip(*carried):
            if same_start and found.fork_of in (None, branch):
                others = [b for b in carried.branches if b != branch] if found.chained else []
                return Inference(branch, None, False, tip, answer, others, compacts=True)
        if found.chained:
            return Inference(one, found.fork_of, False, tip, answer, carried.branches)
        return Inference(one, None, True, tip)

    def accepted(self, guess: Inference, own: bool) -> None:
        """The request ``guess`` inferred was routed: its tip is the branch's latest, the
        branches its prompt took in are over. ``own``: it started its branch."""
        if guess.tip is not None:
            assert self.chains is not None
            self.chains.record(guess.tip, None if guess.final else guess.branch)
            if not guess.final:
                self.counters.requests_chained += 1
                self.counters.branches_inferred += own
            for done in guess.joined:
                self.end(done)
            self.counters.branches_joined += len(guess.joined)
            self.counters.compactions_inferred += guess.compacts
        self.carry.forget(guess.branch)  # in flight again: its last answer is not its last

    def refused(self, branch: BranchId, own: bool, now: float) -> None:
        """A request of ``branch`` was refused before it was accepted: a branch it started
        ends, one it continued is as idle as before."""
        if branch in self.directory:
            if own:
                self.directory.end(branch)
            elif not self.ledger.busy(branch):
                self.idle_from(branch, now)

    # -- ends ------------------------------------------------------------------------------

    def end(self, branch: BranchId) -> None:
        """E.2 line 13 for a branch the service ends: it leaves the idle orders too."""
        self.directory.end(branch)
        self._idle_since.pop(branch, None)
        self._inferred_idle_since.pop(branch, None)
        if self.chains is not None:
            self.chains.forget(branch)
        self.carry.forget(branch)

    def end_after(self, branch: BranchId) -> None:
        """End ``branch`` when its requests in flight are done: their counts must outlive
        them (a harness's parallel calls on one branch, or an end reported meanwhile)."""
        for f in self.ledger.of_branch(branch):
            f.final = True

    def request_over(self, f: Flight, ok: bool, now: float) -> None:
        """``f`` left the ledger: end its branch if it was to end, else its branch is idle
        from now on, and its answer is the branch's last."""
        if f.final and self.ledger.busy(f.branch):
            self.end_after(f.branch)
        elif f.final:
            if f.branch in self.directory:
                self.end(f.branch)
        elif f.branch in self.directory:
            self.idle_from(f.branch, now)
            if f.answer is not None and ok and not self.ledger.busy(f.branch):
                self.carry.answered(f.branch, f.answer)

    # -- idle branches -----------------------------------------------------------------------

    def limits(self) -> list[tuple[dict[BranchId, float], float]]:
        """Each idle order and how long its branches may idle (orders never swept left out:
        named branches when ``branch_idle_s`` is unset, as in the simulator)."""
        out = []
        if self.server.branch_idle_s is not None:
            out.append((self._idle_since, self.server.branch_idle_s))
        if self.chains is not None:
            out.append((self._inferred_idle_since, self.server.inferred_branch_idle_s))
        return out

    def sweep_every(self) -> float:
        return min(limit for _, limit in self.limits()) / 8

    def idle_from(self, branch: BranchId, now: float) -> None:
        """``branch`` has nothing in flight since ``now``: it goes to the back of its idle
        order (not kept at all when its kind of branch is never ended for being idle)."""
        inferred = self.chains is not None and branch in self.chains
        if inferred or self.server.branch_idle_s is not None:
            order = self._inferred_idle_since if inferred else self._idle_since
            order.pop(branch, None)
            order[branch] = now

    def sweep(self, now: float) -> bool:
        """End the branches idle for their limit (E.2 line 13, on their harness's behalf);
        a branch is idle from the end of its last request, so one in flight is never ended.
        True if any was ended."""
        ended = False
        for order, limit in self.limits():
            cutoff = now - limit
            due = []
            for branch, since in order.items():
                if since > cutoff:
                    break
                due.append((branch, since))
            for branch, since in due:
                del order[branch]
                if not self.ledger.busy(branch) and branch in self.directory:
                    self.end(branch)
                    ended = True
                    self.counters.branches_expired += 1
                    log.info("branch_expired", branch=branch, idle_s=round(now - since, 3))
        return ended
