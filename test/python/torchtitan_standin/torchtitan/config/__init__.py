"""Stand-in of torchtitan.config (v0.2.2): the JobConfig fields the loss path reads.

Written for cegen's tests. As TorchTitan's ``config/job_config.py``: ``JobConfig`` is a
dataclass of sections; ``compile.enable`` with ``"loss"`` in ``compile.components`` makes
TorchTitan's loss builder compile the loss. ``with_custom(module)`` does what
``ConfigManager._merge_configs`` does with ``--job.custom_config_module``: a new JobConfig
class with the custom module's ``JobConfig`` fields added.
"""

import importlib
from dataclasses import dataclass, field, fields, make_dataclass
from typing import List


@dataclass
class Compile:
    enable: bool = False
    components: List[str] = field(default_factory=lambda: ["model", "loss"])
    backend: str = "inductor"


@dataclass
class Model:
    name: str = "llama3"
    flavor: str = "debugmodel"


@dataclass
class Training:
    local_batch_size: int = 2
    seq_len: int = 16
    steps: int = 4


@dataclass
class Experimental:
    custom_import: str = ""


@dataclass
class JobConfig:
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    compile: Compile = field(default_factory=Compile)
    experimental: Experimental = field(default_factory=Experimental)


def with_custom(module_path: str) -> type:
    """The JobConfig class extended with ``module_path``'s JobConfig fields."""
    custom = importlib.import_module(module_path).JobConfig
    known = {f.name for f in fields(JobConfig)}
    extra = [(f.name, f.type, f) for f in fields(custom) if f.name not in known]
    return make_dataclass("MergedJobConfig", extra, bases=(JobConfig,))
