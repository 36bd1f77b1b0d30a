"""``triton.runtime`` of the CPU placeholder: ``driver.active`` raises as real triton does on a
machine without a GPU, which is how SGLang (``fla/utils.py``) and torch learn there is none."""

import sys

from _placeholder import install


class _Driver:
    @property
    def active(self):
        raise RuntimeError("0 active drivers ([]). There should only be one. (CPU placeholder)")


driver = _Driver()
install(sys.modules[__name__])
