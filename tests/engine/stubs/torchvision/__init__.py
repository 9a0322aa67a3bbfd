"""An import-only stand-in for torchvision, on the path of the engine check's SGLang processes only.

SGLang 0.5.23 imports torchvision from multimodal modules that its server-args and memory-cache imports pull in;
the real package drags a CUDA build of torch into the CPU venv (see the peer-bench recipe). Nothing the check runs
uses it: every attribute, at any depth, is one inert placeholder.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Inert(type):
    """Placeholder class: any attribute, call or instantiation yields the placeholder again."""

    def __getattr__(cls, name):
        return cls

    def __call__(cls, *args, **kwargs):
        return cls


class Placeholder(metaclass=_Inert):
    """What every torchvision name resolves to."""


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `torchvision.<anything>` to an empty package whose names are the placeholder."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: Placeholder
        return module

    def exec_module(self, module):
        return None


__version__ = "0.0.0"
sys.meta_path.insert(0, _Submodules())


def __getattr__(name):
    return Placeholder
