"""The systems evinfra is compared with, as alternative parts of the one control plane
(paper 3, 6.1, A.1, A.3, A.4, D.5, D.6; issue 7). See ``README.md`` for the module map and
:mod:`evinfra.baselines.policy` for the ``[policy]`` section that selects them."""

from evinfra.baselines.policy import (POLICIES, PRESETS, Components, PolicyConfig, PolicySpec,
                                      build, engine_overrides, resolve)

__all__ = ["POLICIES", "PRESETS", "Components", "PolicyConfig", "PolicySpec", "build",
           "engine_overrides", "resolve"]
