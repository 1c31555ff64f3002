"""Package faces that load a name's module on first use (`agent.service`, `agent.transport`,
`firmware_rollout`): a device that never uses a part never pays for importing it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, module_of: Mapping[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: a name in `module_of` is imported from its module
    on first use and kept in the package, so the next use is a plain attribute."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__


__all__ = ["lazy_attributes"]
