"""Permissive placeholder modules for packages SGLang imports at module level but never calls
on the CPU path of a tiny Llama (see ``../README.md``).

A placeholder module answers every attribute and every submodule import with a
:class:`Placeholder`, which tolerates the module-level uses SGLang makes of these packages
(decorating kernels, reading dtypes and constants, subclassing nothing) and raises a clear
error the moment something is actually *run*. So a code path we believed dead fails loudly
instead of computing garbage.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class ShadowedCallError(NotImplementedError):
    pass


class PlaceholderMeta(type):
    """Placeholder *classes* (names that start upper-case): real types, so ``isinstance``,
    subclassing and ``except`` clauses work; their attributes are placeholders too."""

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{cls.__module__}.{cls.__qualname__}.{name}")

    def __getitem__(cls, item):
        return cls


def placeholder_class(path: str) -> type:
    module, _, name = path.rpartition(".")

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{path}().{attr}")

    return PlaceholderMeta(name, (), {"__module__": module, "__qualname__": name,
                                      "__init__": __init__, "__getattr__": __getattr__})


def _child(path: str, name: str):
    full = f"{path}.{name}"
    return placeholder_class(full) if name[:1].isupper() else Placeholder(full)


class Placeholder:
    """Any attribute is another placeholder; calling it raises, except as a decorator.

    ``@triton.jit`` / ``@triton.autotune(...)`` style uses get a :class:`Kernel` back so the
    module that defines kernels imports; launching one raises.
    """

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> "Placeholder":
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _child(self._path, name)

    def __call__(self, *args, **kwargs):
        # Bare decorator (@x) or decorator factory (@x(...)): keep the module importable.
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], Placeholder):
            return Kernel(self._path, args[0])
        if self._path.split(".")[0] == "triton":
            return Placeholder(f"{self._path}()")
        raise ShadowedCallError(f"{self._path} is a CPU placeholder (evinfra test shadow)")

    def __getitem__(self, item) -> "Placeholder":
        return Placeholder(f"{self._path}[...]")

    def __repr__(self) -> str:
        return f"<placeholder {self._path}>"

    def __bool__(self) -> bool:
        return False

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)


class Kernel:
    """What a shadowed kernel decorator returns: importable, never launchable."""

    def __init__(self, path: str, fn) -> None:
        self._path = path
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid):
        return self._launch

    def __call__(self, *args, **kwargs):
        return self._launch(*args, **kwargs)

    def _launch(self, *args, **kwargs):
        raise ShadowedCallError(
            f"kernel {self.__name__} ({self._path}) launched on a CPU placeholder")

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._path}.{self.__name__}.{name}")


class PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _child(self.__name__, name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``root.*`` submodules as placeholder modules."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        parent, _, child = module.__name__.rpartition(".")
        setattr(sys.modules[parent], child, module)


def install(module: types.ModuleType) -> None:
    """Make ``module`` (a package's ``__init__``) a placeholder package.

    The finder goes *last* on ``sys.meta_path``: a real file under the shadow package (such as
    ``triton/runtime/__init__.py``) still wins over a generated placeholder submodule."""
    module.__class__ = PlaceholderModule
    if "." not in module.__name__:
        sys.meta_path.append(_Finder(module.__name__))
