"""Triton kernels with their torch references (one module per kind) and their launchers."""
from __future__ import annotations


def compiled_variants() -> dict[str, int]:
    """{kernel name: Triton variants compiled or loaded from the cache in this process so far}, over
    headrace's kernel modules, each kernel once however many modules import it. A variant that appears
    while requests run (a constexpr or an integer's specialisation not seen before) stalls every request
    for its compile or load."""
    import importlib
    import pkgutil

    import triton

    fns = {fn for info in pkgutil.iter_modules(__path__)
           for fn in vars(importlib.import_module(f"{__name__}.{info.name}")).values()
           if isinstance(fn, triton.runtime.JITFunction)}
    counts = {f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}":
              sum(len(cache[0]) for cache in fn.device_caches.values()) for fn in fns}
    return {name: n for name, n in sorted(counts.items()) if n}
