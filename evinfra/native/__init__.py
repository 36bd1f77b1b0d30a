"""evinfra's native core: the per-block hot path in C++ (issue 37; see README.md here).

Built by the package's own build (``pip install -e .``, scikit-build-core and CMake). The
Python modules that use it (``core.hashing``, ``directory``, ``drivers.fake.cache``) are thin
shells around these classes.
"""

try:
    from evinfra.native import _native
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "evinfra's native core is not built: run `pip install -e .` (or `make install`) in "
        f"the repository ({e})") from e

__all__ = ["_native"]
