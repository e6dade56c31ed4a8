"""Stand-in of Primus's patch system (``primus.core.patches``), written for cegen's tests.

It mirrors the interface cegen.primus uses and the behaviour its tests rely on, from
Primus's ``primus/core/patches/`` (context.py, patch_registry.py, patch_runner.py):
``register_patch(patch_id, *, description, backend, phase, condition, priority, ...)``
registers a patch in a global ``PatchRegistry`` (a patch registered again under the same
id replaces the earlier one); ``run_patches(backend=..., phase=..., extra=...)`` builds a
``PatchContext``, keeps the patches of that backend and phase whose condition holds (a
condition that raises stops the run), runs them by ascending priority (ties in
registration order) and returns how many were applied; a handler that raises is logged and
skipped, as Primus does. ``get_args(ctx)`` is ``ctx.extra["module_config"].params``.
"""

from .context import PatchContext, get_args
from .patch_registry import FunctionPatch, PatchRegistry, register_patch
from .patch_runner import run_patches

__all__ = ["PatchContext", "get_args", "FunctionPatch", "PatchRegistry", "register_patch",
           "run_patches"]
