"""Import-only stand-in for torchvision, for nsa_cp's SGLang tests on CPU (never installed with nsa_cp).

Why it exists: SGLang 0.5.23 imports torchvision at import time (``layers/cp/zigzag.py`` -> ... ->
``multimodal/internvl_utils.py``: ``import torchvision.transforms as T``; transformers, which SGLang
imports, then imports ``torchvision.io`` and others because it finds a torchvision), but the CP and
layer-boundary code the tests run never calls it. No torchvision on the package registry loads beside
the CPU torch 2.13.0 of the test environment (each wheel is built against its own torch: importing one
fails with "operator torchvision::nms does not exist"), and SGLang's own pin, torch 2.14.1 with its
torchvision, is about 5.5 GB of CUDA wheels. ``tests/sglang_env.py`` puts this directory on ``sys.path``
only where no real torchvision can be found.

What it does: every ``torchvision.<sub>`` module imports, and every name in it is a placeholder.
Placeholders can be looked up and chained (``T.InterpolationMode.BICUBIC``) but calling one raises
RuntimeError, so a test that did reach torchvision fails loudly instead of passing on a stand-in.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+nsa-cp-test-stand-in"
NSA_CP_STAND_IN = True


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: called on nsa_cp's import-only test stand-in for torchvision")

    def __mro_entries__(self, bases):  # used as a base class: an empty one
        return (object,)

    def __repr__(self):
        return f"<torchvision stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Placeholder(f"{__name__}.{attr}")
