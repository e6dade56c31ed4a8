"""Stand-in of primus.core.patches.context: the context handed to every patch."""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class PatchContext:
    backend: str
    phase: str
    backend_version: Optional[str] = None
    primus_version: Optional[str] = None
    model_name: Optional[str] = None
    module_name: Optional[str] = None
    platform: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)


def get_args(ctx: PatchContext) -> Any:
    """The module's parameters (``module_config.params``)."""
    module_config = ctx.extra.get("module_config")
    assert module_config is not None, "module_config is required in patch context"
    params = getattr(module_config, "params", None)
    assert params is not None, "module_config.params is required in patch context"
    return params
