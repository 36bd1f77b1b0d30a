"""CPU placeholder for ``triton`` (641 MB saved): imported at module level by SGLang
(``srt/utils/common.py`` and kernel modules). Kernel decorators return kernels that raise when
launched; ``runtime.driver.active`` raises as real triton does on a machine without a GPU, which
is how SGLang's own checks learn there is none."""

import sys

from _placeholder import install

__version__ = "3.6.0"


def cdiv(x, y):
    return (x + y - 1) // y


def next_power_of_2(n):
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


from . import runtime  # noqa: E402 - the real file, before attribute access turns permissive

install(sys.modules[__name__])
