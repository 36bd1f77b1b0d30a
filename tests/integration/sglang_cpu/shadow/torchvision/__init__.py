"""CPU placeholder for ``torchvision``: imported at module level by SGLang's multimodal utils,
and by ``transformers`` whenever a ``torchvision`` module can be found; PyPI's wheel is a CUDA
build that fails against the CPU torch (``torchvision::nms does not exist``). A text-only model
never runs it, so a placeholder package (every attribute and submodule a placeholder that raises
when called) is enough."""

import sys

from _placeholder import install

__version__ = "0.29.1"  # what transformers' version checks read; nothing of it runs
install(sys.modules[__name__])
