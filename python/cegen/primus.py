"""Primus integration: cegen's Megatron patch as a patch of Primus's own registry.

Primus (AMD-AGI/Primus) drives Megatron-LM and applies its changes to it as registered
patches (``primus.core.patches.register_patch``), each run at a phase of the training
lifecycle when its condition holds. Importing this module registers two of them for the
Megatron backend's ``before_train`` phase:

* ``megatron.cegen.cross_entropy`` (priority :data:`PRIORITY`), condition
  ``use_turbo_cross_entropy``: installs :mod:`cegen.megatron`'s patch of
  ``LanguageModule.compute_language_model_loss``, the same supported-case dispatch and
  logged-once fallback the Megatron entry point installs (one implementation, two entry
  points), at any tensor-parallel size, with ``turbo_ce_overwrite_input``,
  ``turbo_ce_fused_gradient`` (on by default) and ``turbo_ce_fuse_output_layer``;
* ``megatron.cegen.cross_entropy.check`` (priority :data:`CHECK_PRIORITY`, after every other
  patch of the phase), same condition: verifies that cegen's method is the one in place.

The settings are Primus training arguments (module parameters): lowest first, the
packaged ``primus_defaults.yaml`` < the experiment YAML's ``modules.pre_trainer.overrides``
< Primus's command line (``--use_turbo_cross_entropy true``); Primus merges the latter two
into ``module_config.params``, which every patch reads. Values must be true or false. No
environment variable enables or changes any of it.

Primus-Turbo patches the same method for the same argument (patch
``megatron.turbo.cross_entropy``, whose function carries ``_primus_turbo_ce``). Only one
fused loss may run, and whichever of the two patches runs second detects the first and says
so (logger ``cegen.primus``, WARNING): cegen's patch (priority 60, after Turbo's default 50)
finds Turbo's function and replaces it, putting its own over the function Turbo wrapped;
when Turbo's runs after cegen's instead (a higher priority, or applied by hand), Turbo's
wraps cegen's, and the check, which runs last, finds that, says so and removes Turbo's
layer. Either way cegen's dispatch sits directly on Megatron's own implementation, so its
fallbacks are Megatron's, never Turbo's. To use Turbo's loss instead, do not import this
module.

Making Primus import this module: ``python/primus_with_cegen.py`` is Primus's command line
with this module imported first; pass it to the launcher as ``primus-cli direct --script
/path/to/cegen/python/primus_with_cegen.py -- train pretrain --config exp.yaml``.
docs/primus.md has the alternatives.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Type

from . import megatron as _megatron
from .megatron import TurboCESettings

try:
    from primus.core.patches import PatchContext, register_patch
    from primus.core.patches.patch_registry import PatchRegistry
except ImportError as _error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "cegen.primus registers a patch with Primus's patch registry and needs Primus "
        "importable (primus-cli puts the Primus checkout on PYTHONPATH; without it, add the "
        f"checkout to PYTHONPATH): {_error}"
    ) from _error

__all__ = [
    "PATCH_ID",
    "CHECK_PATCH_ID",
    "PRIMUS_TURBO_PATCH_ID",
    "PRIORITY",
    "CHECK_PRIORITY",
    "DEFAULTS_FILE",
    "settings_from_context",
    "enabled",
    "apply_patch",
    "check_patch",
    "register",
]

logger = logging.getLogger(__name__)

PATCH_ID = "megatron.cegen.cross_entropy"
CHECK_PATCH_ID = "megatron.cegen.cross_entropy.check"
#: Primus-Turbo's patch of the same method, and the attribute its function carries.
PRIMUS_TURBO_PATCH_ID = "megatron.turbo.cross_entropy"
PRIMUS_TURBO_MARKER = "_primus_turbo_ce"
#: After Primus-Turbo's cross-entropy patch (the default priority, 50): cegen's runs second.
PRIORITY = 60
#: After every patch of the phase.
CHECK_PRIORITY = 1_000_000
#: The packaged defaults (lowest precedence), a Primus module preset.
DEFAULTS_FILE = Path(__file__).with_name("primus_defaults.yaml")

_METHOD = "compute_language_model_loss"
_LANGUAGE_MODULE_PATH = "megatron.core.models.common.language_module.language_module"
_SETTING_NAMES = tuple(TurboCESettings.__dataclass_fields__)


# -- settings -----------------------------------------------------------------------------


def _module_params(ctx: PatchContext) -> Any:
    """The module's parameters as Primus hands them to patches (``module_config.params``,
    which after argument conversion are the backend arguments), or None."""
    extra: Dict[str, Any] = getattr(ctx, "extra", None) or {}
    params = getattr(extra.get("module_config"), "params", None)
    return params if params is not None else extra.get("backend_args")


def settings_from_context(ctx: PatchContext) -> TurboCESettings:
    """The settings: each key from the module's parameters (experiment YAML overrides, then
    Primus's command line, merged by Primus), else from :data:`DEFAULTS_FILE`.

    Raises:
        ValueError: a value that is not true or false (Primus's command line turns
            ``true`` / ``false`` into booleans; ``1``, ``yes``, ``'true'`` in quotes are
            rejected, so a typo cannot switch anything).
    """
    defaults = _megatron.load_settings(defaults_yaml=DEFAULTS_FILE)
    params = _module_params(ctx)
    values = {}
    for name in _SETTING_NAMES:
        value = getattr(params, name, None) if params is not None else None
        if value is None:
            value = getattr(defaults, name)
        if not isinstance(value, bool):
            raise ValueError(f"Primus argument '{name}' must be true or false, got {value!r}")
        values[name] = value
    return TurboCESettings(**values)


def enabled(ctx: PatchContext) -> bool:
    """The patches' condition: ``use_turbo_cross_entropy``."""
    return settings_from_context(ctx).use_turbo_cross_entropy


# -- the two layers that may sit on compute_language_model_loss -----------------------------


def _is_cegen_layer(function: Any) -> bool:
    """Whether ``function`` is cegen.megatron's patched method. Told by its code, not its
    attributes: ``functools.wraps`` copies a function's ``__dict__`` to its wrapper, so a
    wrapper of cegen's carries cegen's attributes, and cegen's wrapper of Turbo's Turbo's."""
    code = getattr(function, "__code__", None)
    if code is None or code.co_name != _METHOD:
        return False
    try:
        return Path(code.co_filename).resolve() == Path(_megatron.__file__).resolve()
    except OSError:
        return False


def _is_primus_turbo_layer(function: Any) -> bool:
    return bool(getattr(function, PRIMUS_TURBO_MARKER, False)) and not _is_cegen_layer(function)


def _language_module_class() -> Type[Any]:
    return importlib.import_module(_LANGUAGE_MODULE_PATH).LanguageModule


def _current(cls: Type[Any]) -> Optional[Callable[..., Any]]:
    return cls.__dict__.get(_METHOD)


# -- the patches ----------------------------------------------------------------------------


def apply_patch(ctx: PatchContext) -> None:
    """``megatron.cegen.cross_entropy``: cegen.megatron's patch with the context's settings,
    in place of Primus-Turbo's patch of the same method if that ran first."""
    settings = settings_from_context(ctx)
    cls = _language_module_class()
    current = _current(cls)
    if _is_primus_turbo_layer(current):
        below = getattr(current, "__wrapped__", None)
        if below is not None:
            logger.warning(
                "Primus-Turbo's cross-entropy patch (%s) replaced %s.%s before cegen's patch "
                "(%s) ran; both are switched on by use_turbo_cross_entropy. cegen's patch "
                "replaces it: cegen computes the loss where supported and falls back to the "
                "implementation Primus-Turbo had wrapped, so Primus-Turbo's loss no longer "
                "runs.", PRIMUS_TURBO_PATCH_ID, cls.__name__, _METHOD, PATCH_ID)
            setattr(cls, _METHOD, below)
        else:
            logger.warning(
                "Primus-Turbo's cross-entropy patch (%s) replaced %s.%s before cegen's patch "
                "(%s) ran, and the function it wrapped cannot be found (no __wrapped__): "
                "cegen's patch goes on top of it, so cegen's fallbacks run Primus-Turbo's "
                "patch.", PRIMUS_TURBO_PATCH_ID, cls.__name__, _METHOD, PATCH_ID)
    _megatron.install(settings, language_module_cls=cls)
    logger.info("%s: cegen's cross entropy installed on %s.%s (overwrite_input=%s, "
                "fused_gradient=%s, fuse_output_layer=%s)", PATCH_ID, cls.__name__, _METHOD,
                settings.turbo_ce_overwrite_input, settings.turbo_ce_fused_gradient,
                settings.turbo_ce_fuse_output_layer)


def check_patch(ctx: PatchContext) -> None:
    """``megatron.cegen.cross_entropy.check``: after every patch of the phase, cegen's method
    must be the one in place; a Primus-Turbo layer put over it is reported and removed."""
    del ctx
    cls = _language_module_class()
    current = _current(cls)
    if _is_cegen_layer(current):
        return
    below = current
    while _is_primus_turbo_layer(below):
        below = getattr(below, "__wrapped__", None)
    if below is not current and _is_cegen_layer(below):
        logger.warning(
            "Primus-Turbo's cross-entropy patch (%s) ran after cegen's patch (%s) and wrapped "
            "it (both are switched on by use_turbo_cross_entropy): Primus-Turbo's loss would "
            "run for the cases it takes and cegen's for the rest. cegen removes Primus-Turbo's "
            "layer, so cegen computes the loss where supported and falls back to Megatron's "
            "own implementation.", PRIMUS_TURBO_PATCH_ID, PATCH_ID)
        setattr(cls, _METHOD, below)
        return
    logger.warning(
        "cegen's patch (%s) is not in place on %s.%s after the before_train patches: it "
        "failed (see Primus's log above) or another patch replaced it with %r, so cegen does "
        "not compute the loss.", PATCH_ID, cls.__name__, _METHOD, current)


def register() -> None:
    """Registers both patches with Primus's registry (again only if another function was
    registered under their ids)."""
    patches = (
        (PATCH_ID, apply_patch, PRIORITY,
         "Compute Megatron's language-model loss with cegen's fused cross-entropy kernels "
         "(use_turbo_cross_entropy, turbo_ce_overwrite_input, turbo_ce_fused_gradient, "
         "turbo_ce_fuse_output_layer)"),
        (CHECK_PATCH_ID, check_patch, CHECK_PRIORITY,
         "Check that cegen's cross entropy is the loss in place after the before_train patches"),
    )
    for patch_id, handler, priority, description in patches:
        existing = PatchRegistry.get(patch_id)
        if existing is not None and existing.handler is handler:
            continue
        register_patch(patch_id, backend="megatron", phase="before_train",
                       condition=enabled, priority=priority,
                       description=description)(handler)


register()
