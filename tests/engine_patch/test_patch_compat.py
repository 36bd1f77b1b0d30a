"""The patch's SGLang check (``compat``), against a fake module tree: every problem is named;
the supported version with every target present has none."""

import types

import pytest

from evinfra.engine_patch.compat import (SUPPORTED_SGLANG, PatchMismatch, problems,
                                         resolve_target, unapplied)
from evinfra.engine_patch.settings import PatchSettings

GOOD = SUPPORTED_SGLANG[0]


class Scheduler:
    def run_batch(self):
        pass

    limit = 3


MODULES = {"sg.sched": types.SimpleNamespace(Scheduler=Scheduler),
           "sg.sched.Scheduler": Scheduler}


def resolve(name):
    try:
        return MODULES[name]
    except KeyError:
        raise ImportError(f"No module named {name!r}") from None


def test_the_supported_version_with_every_target_has_no_problem():
    assert problems(GOOD, ["sg.sched.Scheduler.run_batch"], resolve) == []
    assert resolve_target("sg.sched.Scheduler.run_batch", resolve) is Scheduler.run_batch


def test_each_problem_is_named():
    found = problems("0.6.0", ["sg.sched.Scheduler.run_batch", "sg.sched.Scheduler.gone",
                               "sg.other.f", "sg.sched.Scheduler.limit", "sg.sched.Scheduler"],
                     resolve)
    assert found[0] == f"SGLang 0.6.0 (supported: {', '.join(SUPPORTED_SGLANG)})"
    assert found[1].startswith("hook target sg.sched.Scheduler.gone not found (AttributeError")
    assert found[2].startswith("hook target sg.other.f not found (ImportError")
    assert found[3] == "hook target sg.sched.Scheduler.limit is not a function (int)"
    assert found[4] == "hook target sg.sched.Scheduler is not a function (type)"
    assert len(found) == 5


def test_hooks_sglang_did_not_apply_are_named():
    assert unapplied(["a.b", "c.d"], {"a.b"}) == [
        "hook on c.d was not applied (see SGLang's 'Failed to apply hooks' log)"]
    assert unapplied(["a.b"], {"a.b", "x.y"}) == []


def test_the_refusal_says_what_to_do():
    msg = str(PatchMismatch(["SGLang 0.6.0 (supported: 0.5.23)"]))
    assert "refusing to start" in msg and "EVINFRA_PATCH_ON_MISMATCH=stock" in msg
    assert "  - SGLang 0.6.0" in msg


def test_the_mismatch_mode_is_refuse_unless_the_operator_says_stock():
    assert PatchSettings.from_env({}).on_mismatch == "refuse"
    assert PatchSettings.from_env({"EVINFRA_PATCH_ON_MISMATCH": "stock"}).on_mismatch == "stock"
    with pytest.raises(ValueError, match="refuse or stock"):
        PatchSettings.from_env({"EVINFRA_PATCH_ON_MISMATCH": "ignore"})
