"""CPU placeholder for ``sgl_kernel``: the PyPI ``sglang-kernel`` needs ``libcuda.so.1`` to
import. None of its kernels runs for a tiny Llama with the CPU launch flags; any call raises."""

import sys

from _placeholder import install

__version__ = "0.0.0+evinfra.cpu.placeholder"
install(sys.modules[__name__])
