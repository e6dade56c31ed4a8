"""Stand-in of Primus's training runtime up to the before_train patches, for cegen's tests.

It follows the steps of Primus's ``primus/core/runtime/train_runtime.py`` (with
``primus/core/launcher/parser.py`` and ``primus/core/utils/arg_utils.py``) that decide what
a patch sees: the experiment YAML's ``modules.<name>`` names a module preset (``config``)
whose keys become the module's parameters, its ``overrides`` are deep-merged over them,
then the command-line overrides (``--key value``, ``--key=value``, ``key=value``; ``true`` /
``false`` become booleans, integers and floats numbers) are deep-merged over those, and the
``before_train`` patches run with ``extra={"module_config": ..., "backend_args": ...}``.
The one module preset here, ``pre_trainer.yaml``, holds a few of Megatron's arguments.
"""

from copy import deepcopy
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import yaml

from primus.core.patches import run_patches

PRESETS: Dict[str, Dict[str, Any]] = {
    "pre_trainer.yaml": {"train_iters": 1000, "micro_batch_size": 2,
                         "tensor_model_parallel_size": 1, "cross_entropy_loss_fusion": False},
}


def deep_merge(base: Dict[str, Any], override: Dict[str, Any]) -> Dict[str, Any]:
    merged = deepcopy(base)
    for key, value in override.items():
        if isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _coerce(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return raw


def parse_cli_overrides(tokens: List[str]) -> Dict[str, Any]:
    """``["--a", "1", "--b=true", "c.d=x"]`` -> ``{"a": 1, "b": True, "c": {"d": "x"}}``."""
    pairs = []
    index = 0
    while index < len(tokens):
        token = tokens[index].strip()
        if "=" in token:
            key, value = token.split("=", 1)
            index += 1
        elif token.startswith("--") and index + 1 < len(tokens):
            key, value = token, tokens[index + 1]
            index += 2
        else:
            raise ValueError(f"cannot parse override {token!r}")
        pairs.append((key.lstrip("-").strip(), value.strip()))
    result: Dict[str, Any] = {}
    for key, value in pairs:
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _coerce(value)
    return result


def _namespace(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in value.items()})
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, SimpleNamespace):
        return {k: _plain(v) for k, v in vars(value).items()}
    return value


def load_module_config(config_path: str, module_name: str = "pre_trainer") -> SimpleNamespace:
    with open(config_path, "r", encoding="utf-8") as stream:
        experiment = yaml.safe_load(stream)
    module = experiment["modules"][module_name]
    params = deep_merge(PRESETS[module["config"]], module.get("overrides") or {})
    return SimpleNamespace(name=module_name, framework=module["framework"],
                           params=_namespace(params))


def apply_overrides(module_config: SimpleNamespace, overrides: Optional[List[str]]) -> None:
    if overrides:
        merged = deep_merge(_plain(module_config.params), parse_cli_overrides(overrides))
        module_config.params = _namespace(merged)


def run_before_train(module_config: SimpleNamespace) -> int:
    return run_patches(backend=module_config.framework, phase="before_train",
                       module_name=module_config.name,
                       extra={"module_config": module_config,
                              "backend_args": module_config.params})
