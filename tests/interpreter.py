"""The Triton interpreter, made cheaper for the CPU suite.

Inside an interpreted kernel every call of a @triton.jit helper patches
triton.language again (triton.runtime.interpreter._patch_lang walks the
modules with inspect.getmembers: about a millisecond a call), although the
kernel's launch has already patched it and only restores it when the launch
ends. A decode attention test makes some 14,000 such calls. Here a helper's
call skips that step while its thread's launch is running and the modules it
names are still patched; a launch itself, and a helper that finds them
unpatched (or names one not yet patched in this launch), patches as before.
Nothing else changes: a helper's patches were never restored, and still are
not."""
from __future__ import annotations

import inspect
import threading


def skip_nested_patching() -> bool:
    """Install the shortcut; False (nothing changed) where this Triton's interpreter lacks what it relies on."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "skips_nested", False):
        return False
    modules = (tl, tl.core)  # what _patch_lang patches, as a function's globals name them
    unpatched_load = {id(m): m.load for m in modules}
    state = threading.local()  # .langs: the module ids patched in the running launch (None: no launch)
    named: dict = {}  # function -> langs_of(function): its globals name the same modules at every call

    def langs_of(fn) -> frozenset[int]:
        langs = named.get(fn)
        if langs is None:
            langs = named[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                          if inspect.ismodule(v) and v in modules)
        return langs

    def patched(langs) -> bool:
        return all(m.load is not unpatched_load[id(m)] for m in modules if id(m) in langs)

    class LaunchScope:
        """A launch's patches: restoring them ends the launch."""

        def __init__(self, scope) -> None:
            self.scope = scope

        def restore(self) -> None:
            try:
                self.scope.restore()
            finally:
                state.langs = None

    def patch_lang(fn):
        langs, mine = getattr(state, "langs", None), langs_of(fn)
        if langs is not None and mine <= langs and patched(mine):
            return scope_type()  # a helper inside the launch: already patched, nothing to restore
        scope = original(fn)
        if langs is None:  # a launch, which restores its scope when it ends
            state.langs = mine
            return LaunchScope(scope)
        state.langs = langs | mine  # a helper (triton.language's own name tl.core too): patched from here on
        return scope

    patch_lang.skips_nested = True
    interpreter._patch_lang = patch_lang
    return True
