"""cegen.primus in a real fetched Primus (not a unittest module; test_primus.py runs it).

Usage (test_primus.TestRealPrimus runs it in a fresh process, so that the real ``primus``
package is not mixed with the stand-in)::

    python3 _primus_real_check.py --primus PRIMUS_CHECKOUT --out RESULT.json [--cache-dir DIR]

With the real Primus first on ``sys.path`` (its ``primus`` package: the patch registry, the
config loader, the runtime and the command line) and the Megatron stand-in for
``LanguageModule``, each scenario sets ``sys.argv`` to a Primus training command and calls
``python/primus_with_cegen.py``'s ``main()``, which imports cegen.primus and hands over to
Primus's own ``primus.cli.main.main()``: Primus parses the command line, loads the experiment
YAML through its presets (``modules.pre_trainer.overrides`` merged in), applies the
command-line overrides and runs the ``before_train`` patches of its real registry. Two
runtime steps are replaced, as nothing here can run them: the environment set-up (paths,
distributed, logging) and the backend (Megatron argument conversion, trainer, training); the
replacement runs the ``before_train`` phase exactly as ``_run_trainer_lifecycle`` does. The
result records, per scenario, whether cegen's method is in place on LanguageModule, its
settings, the warnings of ``cegen.primus`` and, where the runtime library loads, a loss
through it against the unpatched stand-in's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


EXPERIMENT = """\
work_group: cegen
user_name: test
exp_name: cegen_switch
workspace: {workspace}
modules:
  pre_trainer:
    framework: megatron
    config: pre_trainer.yaml
    model: llama2_7B.yaml
    overrides:
      cross_entropy_loss_fusion: true
{overrides}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--primus", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    sys.path[:0] = [str(args.primus), str(REPO / "python"), str(HERE / "megatron_standin")]

    import torch

    import cegen
    import primus_with_cegen

    if args.cache_dir is not None:
        cegen.configure(cache_dir=args.cache_dir)
    from megatron.core.models.common.language_module import language_module
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt.gpt_model import TinyGPTModel
    from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from primus.core.patches import register_patch
    from primus.core.patches.patch_registry import PatchRegistry
    from primus.core.runtime.train_runtime import PrimusRuntime

    original = LanguageModule.__dict__["compute_language_model_loss"]
    work = Path(tempfile.mkdtemp(prefix="cegen-primus-real-"))
    records = Records()
    logging.getLogger("cegen.primus").addHandler(records)

    def before_train_only(self: Any) -> None:
        # _initialize_backend_and_execute without the backend: the before_train phase as
        # _run_trainer_lifecycle runs it, with the module config Primus built.
        self._run_phase_patches(phase="before_train", backend_args=self.ctx.module_config.params)

    PrimusRuntime._initialize_runtime_environment = lambda self: None
    PrimusRuntime._initialize_backend_and_execute = before_train_only

    turbo_path = (HERE / "primus_standin" / "primus" / "backends" / "megatron" / "patches"
                  / "turbo" / "cross_entropy_patches.py")

    def load_turbo_standin(priority: Optional[int]) -> Any:
        """The Primus-Turbo stand-in, registered in the real registry (at ``priority``)."""
        spec = importlib.util.spec_from_file_location("turbo_ce_standin", turbo_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if priority is not None:
            register_patch("megatron.turbo.cross_entropy", backend="megatron",
                           phase="before_train", condition=module._enabled,
                           priority=priority)(module.patch_cross_entropy)
        return module

    def loss_check() -> Dict[str, Any]:
        """A loss through the patched method against the unpatched stand-in's."""
        if not cegen.runtime_available():
            return {"skipped": "the runtime library is not built"}
        config = TransformerConfig(cross_entropy_loss_fusion=True)
        groups = ProcessGroupCollection(tp=FakeProcessGroup(1), cp=FakeProcessGroup(1),
                                        pp=FakeProcessGroup(1), embd=None)
        torch.manual_seed(5)
        module = TinyGPTModel(config, hidden_size=16, vocab_size=97, pg_collection=groups)
        hidden = torch.randn(7, 3, 16)
        labels = torch.randint(0, 97, (3, 7))
        calls = language_module.CALLS["compute_language_model_loss"]
        loss = module(hidden, labels).detach()
        fell_back = language_module.CALLS["compute_language_model_loss"] - calls
        expected = original(module, labels, torch.matmul(hidden, module.output_weight.t())).detach()
        return {"max_diff": float((loss - expected).abs().max()), "original_calls": fell_back}

    def snapshot() -> Any:
        return (list(PatchRegistry._all_patches),
                {b: {p: list(v) for p, v in d.items()}
                 for b, d in PatchRegistry._patches_by_backend_phase.items()})

    def restore(saved: Any) -> None:
        PatchRegistry._all_patches[:] = saved[0]
        PatchRegistry._patches_by_backend_phase.clear()
        for backend, phases in saved[1].items():
            for phase, patches in phases.items():
                PatchRegistry._patches_by_backend_phase[backend][phase] = list(patches)

    saved: List[Any] = []  # the registry as the first scenario's launcher left it

    def scenario(name: str, yaml_overrides: str, cli: List[str],
                 turbo_priority: Optional[int] = None) -> Dict[str, Any]:
        LanguageModule.compute_language_model_loss = original
        if saved:
            restore(saved[0])
        records.messages.clear()
        directory = work / name
        directory.mkdir()
        experiment = directory / "exp.yaml"
        experiment.write_text(EXPERIMENT.format(workspace=directory / "ws",
                                                overrides=yaml_overrides), encoding="utf-8")
        turbo = load_turbo_standin(turbo_priority) if turbo_priority is not None else None
        result: Dict[str, Any] = {"cegen_imported_before": "cegen.primus" in sys.modules}
        sys.argv = ["primus_with_cegen.py", "train", "pretrain", "--config", str(experiment),
                    "--data_path", str(directory / "data"), *cli]
        try:
            primus_with_cegen.main()
        except BaseException as error:  # recorded: a bad value must stop the run
            result["error"] = f"{type(error).__name__}: {error}"
            cause = error.__cause__ or error.__context__
            if cause is not None:
                result["error"] += f" <- {type(cause).__name__}: {cause}"
        if not saved:
            saved.append(snapshot())
        from cegen import primus as cegen_primus

        current = LanguageModule.__dict__["compute_language_model_loss"]
        result["cegen_in_place"] = cegen_primus._is_cegen_layer(current)
        result["turbo_in_place"] = cegen_primus._is_primus_turbo_layer(current)
        result["unpatched"] = current is original
        settings = getattr(current, "_cegen_settings", None)
        result["overwrite_input"] = getattr(settings, "turbo_ce_overwrite_input", None)
        result["wraps_original"] = getattr(current, "_cegen_original", None) is original
        result["warnings"] = list(records.messages)
        if result["cegen_in_place"]:
            result["loss"] = loss_check()
        if turbo is not None:
            result["turbo_calls"] = turbo.CALLS["turbo"]
        return result

    on = "      use_turbo_cross_entropy: true\n"
    off = "      use_turbo_cross_entropy: false\n"
    results: Dict[str, Any] = {}
    cases = [
        ("yaml_on", on, []),
        ("yaml_on_cli_off", on, ["--use_turbo_cross_entropy", "false"]),
        ("yaml_off", off, []),
        ("yaml_off_cli_on", off, ["--use_turbo_cross_entropy", "true",
                                  "--turbo_ce_overwrite_input=true"]),
        ("unset", "", []),
        ("unset_cli_on", "", ["use_turbo_cross_entropy=true"]),
        ("yaml_bad_value", "      use_turbo_cross_entropy: 'yes'\n", []),
        ("turbo_first", on, [], 50),
        ("turbo_second", on, [], 70),
    ]
    for name, yaml_overrides, cli, *turbo in cases:
        try:
            results[name] = scenario(name, yaml_overrides, cli, *(turbo or [None]))
        except Exception:
            results[name] = {"crash": traceback.format_exc()}
    from cegen import primus as cegen_primus

    patch = PatchRegistry.get(cegen_primus.PATCH_ID)
    check = PatchRegistry.get(cegen_primus.CHECK_PATCH_ID)
    results["registry"] = {
        "patch": None if patch is None else [patch.backend, patch.phase, patch.priority],
        "check": None if check is None else [check.backend, check.phase, check.priority],
        "primus_file": sys.modules["primus.core.patches"].__file__,
    }
    args.out.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
