"""Finding the engine's kernels: importing every module under `cmpchat.kernels` (and the self-test
kernels) lets their `@kernel` decorators fill `cmpchat.cudart.compile.KERNELS`.

A new kernel module needs no registration anywhere else: the PTX check (CPU) and the SASS check (GPU)
both start here.
"""

from __future__ import annotations

import importlib
import pkgutil
import traceback
from collections.abc import Sequence

from cmpchat.cudart.compile import KERNELS, KernelSpec

KERNEL_PACKAGE = "cmpchat.kernels"
SELFTEST_MODULE = "cmpchat.cudart.selftest_kernels"


def kernel_module_names() -> list[str]:
    """Every module and subpackage under `cmpchat.kernels`, sorted."""
    package = importlib.import_module(KERNEL_PACKAGE)
    found = pkgutil.walk_packages(package.__path__, prefix=f"{KERNEL_PACKAGE}.", onerror=lambda name: None)
    return sorted(info.name for info in found)


def import_kernel_modules(extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """Import the kernel modules, the self-test kernels and `extra` modules.

    Returns the modules imported and, for each module that failed, the end of its traceback (one broken
    module must not hide the others' results).
    """
    imported: list[str] = []
    failed: dict[str, str] = {}
    for name in [*kernel_module_names(), SELFTEST_MODULE, *extra]:
        try:
            importlib.import_module(name)
        except Exception:  # report every broken module, not just the first
            failed[name] = traceback.format_exc(limit=-3).strip()
        else:
            imported.append(name)
    return imported, failed


def registered_kernels() -> list[KernelSpec]:
    """The registry, in registration order (modules import in sorted order, so runs compare line by line)."""
    return list(KERNELS)
