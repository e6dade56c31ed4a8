"""Stand-in of primus.core.patches.patch_runner: runs the applicable patches of a phase."""

import logging
from typing import Any, Dict, List, Optional

from .context import PatchContext
from .patch_registry import PatchRegistry

log = logging.getLogger(__name__)

#: The ids of the patches the last run applied, in order (Primus logs them).
APPLIED: List[str] = []


def run_patches(*, backend: str, phase: str, backend_version: Optional[str] = None,
                primus_version: Optional[str] = None, model_name: Optional[str] = None,
                module_name: Optional[str] = None, platform: Optional[str] = None,
                extra: Optional[Dict[str, Any]] = None,
                enabled_ids: Optional[List[str]] = None) -> int:
    ctx = PatchContext(backend=backend, phase=phase, backend_version=backend_version,
                       primus_version=primus_version, model_name=model_name,
                       module_name=module_name, platform=platform, extra=extra or {})
    patches = PatchRegistry.iter_patches(backend=backend, phase=phase)
    if enabled_ids is not None:
        patches = [p for p in patches if p.id in enabled_ids]
    patches = sorted((p for p in patches if p.applies_to(ctx)), key=lambda p: p.priority)
    APPLIED.clear()
    for patch in patches:
        try:
            patch.apply(ctx)
            APPLIED.append(patch.id)
        except Exception as error:  # Primus logs a failed patch and goes on
            log.error("[Patch] %s failed: %s", patch.id, error)
    log.info("[Patch] Applied %d/%d patches for %s/%s: %s", len(APPLIED), len(patches),
             backend, phase, APPLIED)
    return len(APPLIED)
