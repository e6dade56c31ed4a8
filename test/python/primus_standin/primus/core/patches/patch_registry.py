"""Stand-in of primus.core.patches.patch_registry: the global registry and its decorator.

The class attributes have the names of Primus's (``_all_patches``,
``_patches_by_backend_phase``) so that tests can save and restore either registry alike.
"""

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

log = logging.getLogger(__name__)


@dataclass
class FunctionPatch:
    id: str
    description: str
    handler: Callable[[Any], None]
    backend: Optional[str] = None
    phase: Optional[str] = None
    condition: Optional[Callable[[Any], bool]] = None
    priority: int = 50
    tags: Set[str] = field(default_factory=set)

    def applies_to(self, ctx: Any) -> bool:
        if self.backend is not None and self.backend != ctx.backend:
            return False
        if self.phase is not None and self.phase != ctx.phase:
            return False
        return self.condition is None or bool(self.condition(ctx))

    def apply(self, ctx: Any) -> None:
        self.handler(ctx)


class PatchRegistry:
    _patches_by_backend_phase: Dict[Optional[str], Dict[Optional[str], List[FunctionPatch]]] = \
        defaultdict(lambda: defaultdict(list))
    _all_patches: List[FunctionPatch] = []

    @classmethod
    def register(cls, patch: FunctionPatch) -> FunctionPatch:
        for index, existing in enumerate(cls._all_patches):
            if existing.id == patch.id:
                log.warning("Patch '%s' already registered; overriding.", patch.id)
                bucket = cls._patches_by_backend_phase[existing.backend][existing.phase]
                if existing in bucket:
                    bucket.remove(existing)
                cls._all_patches[index] = patch
                break
        else:
            cls._all_patches.append(patch)
        cls._patches_by_backend_phase[patch.backend][patch.phase].append(patch)
        return patch

    @classmethod
    def get(cls, patch_id: str) -> Optional[FunctionPatch]:
        return next((p for p in cls._all_patches if p.id == patch_id), None)

    @classmethod
    def list_ids(cls) -> List[str]:
        return sorted(p.id for p in cls._all_patches)

    @classmethod
    def iter_patches(cls, backend: str, phase: Optional[str] = None) -> List[FunctionPatch]:
        found: List[FunctionPatch] = []
        for b_key, p_key in ((backend, phase), (None, phase), (backend, None), (None, None)):
            for patch in cls._patches_by_backend_phase.get(b_key, {}).get(p_key, []):
                if patch not in found:
                    found.append(patch)
        return found

    @classmethod
    def clear(cls) -> None:
        cls._patches_by_backend_phase.clear()
        cls._all_patches.clear()


def register_patch(patch_id: str, *, description: str = "", backend: Optional[str] = None,
                   phase: Optional[str] = None, condition: Optional[Callable[[Any], bool]] = None,
                   priority: int = 50, backend_versions=None, primus_versions=None,
                   tags=None) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    def decorator(func: Callable[[Any], None]) -> Callable[[Any], None]:
        PatchRegistry.register(FunctionPatch(
            id=patch_id, description=description or func.__doc__ or "", handler=func,
            backend=backend, phase=phase, condition=condition, priority=priority,
            tags=set(tags or ())))
        return func

    return decorator
