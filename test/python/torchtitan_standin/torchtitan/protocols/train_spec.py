"""Stand-in of torchtitan.protocols.train_spec (v0.2.2), written for cegen's tests.

The ``TrainSpec`` dataclass has v0.2.2's fields; a model names its loss in
``build_loss_fn``. ``register_train_spec`` refuses a name twice; ``get_train_spec`` prefers
a registered spec over a built-in model's (``torchtitan.models.<name>.get_train_spec()``).
"""

from dataclasses import dataclass
from importlib import import_module
from typing import Any, Callable, Dict, Mapping, Optional


@dataclass
class TrainSpec:
    model_cls: type
    model_args: Mapping[str, Any]
    parallelize_fn: Callable
    pipelining_fn: Optional[Callable]
    build_optimizers_fn: Callable
    build_lr_schedulers_fn: Callable
    build_dataloader_fn: Callable
    build_tokenizer_fn: Optional[Callable]
    build_loss_fn: Callable
    build_validator_fn: Optional[Callable] = None
    build_metrics_processor_fn: Optional[Callable] = None
    state_dict_adapter: Optional[type] = None


_extra_train_specs: Dict[str, TrainSpec] = {}


def register_train_spec(name: str, train_spec: TrainSpec) -> None:
    if name in _extra_train_specs:
        raise ValueError(f"TrainSpec {name} is already registered.")
    _extra_train_specs[name] = train_spec


def get_train_spec(name: str) -> TrainSpec:
    if name in _extra_train_specs:
        return _extra_train_specs[name]
    from torchtitan.models import _supported_models

    if name in _supported_models:
        return import_module(f"torchtitan.models.{name}").get_train_spec()
    raise ValueError(f"TrainSpec {name} is not registered.")
