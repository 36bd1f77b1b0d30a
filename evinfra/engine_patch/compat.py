"""Is this SGLang the one the patch was written against? (pure, given a resolver)

SGLang's hook registry logs a target it cannot find and carries on, and its plugin loader logs
a plugin that raised and carries on: on another SGLang a patch would silently lose the hooks
whose targets moved. The plugin therefore checks, before it registers a single hook, that the
SGLang version is one it supports and that every target it is about to hook resolves; and,
once SGLang applied the hooks, that every one of them was applied. On a mismatch the engine
refuses to start with the list of problems, unless the operator set
``EVINFRA_PATCH_ON_MISMATCH=stock``: then the engine runs stock SGLang (no hook at all) after a
loud warning. Never a partial patch.
"""

from __future__ import annotations

import pkgutil
from typing import Callable, Iterable

__all__ = ["SUPPORTED_SGLANG", "ON_MISMATCH_ENV", "PatchMismatch", "problems", "resolve_target",
           "unapplied"]

SUPPORTED_SGLANG = ("0.5.23",)
"""SGLang versions whose internals the hooks were written and tested against."""

ON_MISMATCH_ENV = "EVINFRA_PATCH_ON_MISMATCH"


class PatchMismatch(RuntimeError):
    """The patch cannot be applied whole to this SGLang."""

    def __init__(self, found: list[str]) -> None:
        self.found = found
        super().__init__(
            "evinfra engine patch: refusing to start: this SGLang does not match the patch:\n"
            + "\n".join(f"  - {p}" for p in found)
            + f"\nInstall SGLang {' or '.join(SUPPORTED_SGLANG)}, or set {ON_MISMATCH_ENV}="
            "stock to run stock SGLang without the patch (no switch in place, no count-aware "
            f"eviction, no pool, no fetch), or unset EVINFRA_ENGINE_PATCH.")


def resolve_target(target: str, resolve: Callable[[str], object] = pkgutil.resolve_name
                   ) -> object:
    """The object a hook target names, resolved as SGLang's ``HookRegistry`` does."""
    owner, _, attr = target.rpartition(".")
    if not owner:
        raise ValueError(f"not a dotted target: {target!r}")
    return getattr(resolve(owner), attr)


def problems(version: str, targets: Iterable[str],
             resolve: Callable[[str], object] = pkgutil.resolve_name) -> list[str]:
    """What stands between this SGLang and the whole patch (empty: nothing)."""
    found = []
    if version not in SUPPORTED_SGLANG:
        found.append(f"SGLang {version} (supported: {', '.join(SUPPORTED_SGLANG)})")
    for target in targets:
        try:
            obj = resolve_target(target, resolve)
        except (ImportError, AttributeError, ValueError) as exc:
            found.append(f"hook target {target} not found ({type(exc).__name__}: {exc})")
            continue
        if not callable(obj) or isinstance(obj, type):
            found.append(f"hook target {target} is not a function ({type(obj).__name__})")
    return found


def unapplied(targets: Iterable[str], applied: set[str]) -> list[str]:
    """Targets SGLang's registry did not patch (it logs the failure and carries on)."""
    return [f"hook on {t} was not applied (see SGLang's 'Failed to apply hooks' log)"
            for t in targets if t not in applied]
