"""cegen.primus: cegen's Megatron patch in Primus's patch registry.

Against the Primus stand-in (test/python/primus_standin: the patch registry, the runtime's
config merge and command line, a Primus-Turbo cross-entropy patch) and the Megatron
stand-in, in process: the YAML and command-line switches, the dispatch (float64
references), overwrite-input, the logged fallback, the two orders of cegen's and
Primus-Turbo's patches, the ``primus_with_cegen.py`` launcher (a subprocess), TP = 2 over a
gloo group (two processes). Against a real fetched Primus (:class:`TestRealPrimus`, in a
subprocess, skipped with the reason unless a checkout is found): the same switches through
Primus's own registry, config loader, runtime and command line.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import _support as S

sys.path.insert(0, str(S.HERE / "primus_standin"))

import torch  # noqa: E402
import yaml  # noqa: E402

import cegen  # noqa: E402
from cegen import _config  # noqa: E402
from cegen import megatron as turbo_ce  # noqa: E402
from cegen import primus as cegen_primus  # noqa: E402
from megatron.core.models.common.language_module import language_module  # noqa: E402
from megatron.core.models.common.language_module.language_module import LanguageModule  # noqa: E402
from megatron.core.models.gpt.gpt_model import TinyGPTModel  # noqa: E402
from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel import cross_entropy as tp_cross_entropy  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from primus.core.patches import register_patch  # noqa: E402
from primus.core.patches.patch_registry import PatchRegistry  # noqa: E402
from primus.core.runtime import train_runtime  # noqa: E402

#: A checkout of AMD-AGI/Primus for TestRealPrimus (never committed): CEGEN_PRIMUS_SRC, else
#: .dev/primus (``git archive HEAD primus | tar -x -C .dev/primus`` in a fetched Primus).
REAL_PRIMUS = Path(os.environ.get("CEGEN_PRIMUS_SRC", S.REPO / ".dev" / "primus"))
LAUNCHER = S.REPO / "python" / "primus_with_cegen.py"
TURBO_MODULE = "primus.backends.megatron.patches.turbo.cross_entropy_patches"
ORIGINAL = LanguageModule.__dict__["compute_language_model_loss"]
VOCAB = 4 * 29


def experiment(directory: str, overrides: Dict[str, Any]) -> str:
    """An experiment YAML whose pre_trainer module has these overrides."""
    path = os.path.join(directory, "exp.yaml")
    module = {"framework": "megatron", "config": "pre_trainer.yaml", "model": "tiny.yaml",
              "overrides": dict(overrides)}
    with open(path, "w", encoding="utf-8") as stream:
        yaml.safe_dump({"modules": {"pre_trainer": module}}, stream)
    return path


def current_method() -> Any:
    return LanguageModule.__dict__["compute_language_model_loss"]


def turbo_standin() -> Any:
    """The Primus-Turbo stand-in, imported afresh (registering its patch)."""
    sys.modules.pop(TURBO_MODULE, None)
    import importlib

    return importlib.import_module(TURBO_MODULE)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class PrimusTestCase(unittest.TestCase):
    """Each test starts from the registry and the method as cegen.primus's import left them."""

    def setUp(self) -> None:
        patches = list(PatchRegistry._all_patches)
        buckets = {b: {p: list(v) for p, v in d.items()}
                   for b, d in PatchRegistry._patches_by_backend_phase.items()}

        def restore() -> None:
            PatchRegistry._all_patches[:] = patches
            PatchRegistry._patches_by_backend_phase.clear()
            for backend, phases in buckets.items():
                for phase, bucket in phases.items():
                    PatchRegistry._patches_by_backend_phase[backend][phase] = list(bucket)
            LanguageModule.compute_language_model_loss = ORIGINAL

        self.addCleanup(restore)
        LanguageModule.compute_language_model_loss = ORIGINAL
        turbo_ce.reset_fallback_log()
        cegen.reset_overwrite_warnings()
        self.records = Records()
        logging.getLogger("cegen.primus").addHandler(self.records)
        self.addCleanup(logging.getLogger("cegen.primus").removeHandler, self.records)
        self.directory = tempfile.mkdtemp(prefix="cegen-primus-test-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def run_primus(self, overrides: Dict[str, Any], cli: Optional[List[str]] = None) -> Any:
        """Primus's steps up to the before_train patches: the experiment YAML's overrides,
        then the command line's, then the patches. Returns the module config."""
        module_config = train_runtime.load_module_config(experiment(self.directory, overrides))
        train_runtime.apply_overrides(module_config, cli or [])
        train_runtime.run_before_train(module_config)
        return module_config


class TestRegistration(unittest.TestCase):
    def test_registered_as_primus_registers_its_patches(self) -> None:
        patch = PatchRegistry.get(cegen_primus.PATCH_ID)
        check = PatchRegistry.get(cegen_primus.CHECK_PATCH_ID)
        self.assertEqual((patch.backend, patch.phase), ("megatron", "before_train"))
        self.assertEqual((check.backend, check.phase), ("megatron", "before_train"))
        self.assertIs(patch.handler, cegen_primus.apply_patch)
        self.assertIs(patch.condition, cegen_primus.enabled)
        self.assertIs(check.condition, cegen_primus.enabled)
        self.assertGreater(patch.priority, 50, "must run after Primus-Turbo's (default 50)")
        self.assertGreater(check.priority, patch.priority)

    def test_register_is_idempotent(self) -> None:
        count = len(PatchRegistry._all_patches)
        with self.assertNoLogs(level="WARNING"):
            cegen_primus.register()
        self.assertEqual(len(PatchRegistry._all_patches), count)

    def test_defaults_file(self) -> None:
        with open(cegen_primus.DEFAULTS_FILE, "r", encoding="utf-8") as stream:
            data = yaml.safe_load(stream)
        self.assertEqual(data, {"use_turbo_cross_entropy": False, "turbo_ce_overwrite_input": False,
                                "turbo_ce_fused_gradient": True,
                                "turbo_ce_fuse_output_layer": False})
        pyproject = (S.REPO / "python" / "pyproject.toml").read_text(encoding="utf-8")
        self.assertIn("primus_defaults.yaml", pyproject, "the defaults file is not packaged")
        self.assertIn("primus_with_cegen", pyproject, "the launcher is not packaged")


class TestSwitch(PrimusTestCase):
    """use_turbo_cross_entropy / turbo_ce_overwrite_input from the YAML and the command line."""

    CASES: List[Tuple[Dict[str, Any], List[str], bool, Optional[bool]]] = [
        ({}, [], False, None),
        ({"use_turbo_cross_entropy": True}, [], True, False),
        ({"use_turbo_cross_entropy": True}, ["--use_turbo_cross_entropy", "false"], False, None),
        ({"use_turbo_cross_entropy": False}, [], False, None),
        ({"use_turbo_cross_entropy": False}, ["--use_turbo_cross_entropy=true"], True, False),
        ({}, ["use_turbo_cross_entropy=true"], True, False),
        ({"use_turbo_cross_entropy": True, "turbo_ce_overwrite_input": True}, [], True, True),
        ({"use_turbo_cross_entropy": True, "turbo_ce_overwrite_input": True},
         ["--turbo_ce_overwrite_input", "false"], True, False),
        ({}, ["--use_turbo_cross_entropy", "true", "--turbo_ce_overwrite_input", "true"], True, True),
    ]

    def test_yaml_and_command_line_switch_cegen_on_and_off(self) -> None:
        for overrides, cli, on, overwrite in self.CASES:
            with self.subTest(yaml=overrides, cli=cli):
                LanguageModule.compute_language_model_loss = ORIGINAL
                self.run_primus(overrides, cli)
                self.assertEqual(turbo_ce.is_installed(LanguageModule), on)
                self.assertEqual(cegen_primus._is_cegen_layer(current_method()), on)
                if on:
                    settings = current_method()._cegen_settings
                    self.assertEqual(settings, turbo_ce.TurboCESettings(True, overwrite))
                    self.assertIs(current_method()._cegen_original, ORIGINAL)
                else:
                    self.assertIs(current_method(), ORIGINAL)

    def test_values_that_are_not_booleans_stop_the_run(self) -> None:
        for overrides, cli in (({"use_turbo_cross_entropy": "yes"}, []),
                               ({}, ["--use_turbo_cross_entropy", "1"]),
                               ({"use_turbo_cross_entropy": True, "turbo_ce_overwrite_input": "true"}, [])):
            with self.subTest(yaml=overrides, cli=cli):
                with self.assertRaisesRegex(ValueError, "must be true or false"):
                    self.run_primus(overrides, cli)
                self.assertIs(current_method(), ORIGINAL)

    def test_launcher_registers_the_patch_for_primus_command_line(self) -> None:
        # python/primus_with_cegen.py as primus-cli's --script: a fresh process, cegen found
        # through the script's directory, Primus (here the stand-in) through PYTHONPATH.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(S.HERE / "primus_standin"), str(S.STANDIN)])
        on = experiment(self.directory, {"use_turbo_cross_entropy": True})
        runs = [(["train", "pretrain", "--config", on], True),
                (["--", "train", "pretrain", "--config", on], True),
                (["train", "pretrain", "--config", on, "--use_turbo_cross_entropy", "false"], False)]
        for argv, applied in runs:
            with self.subTest(argv=argv):
                done = subprocess.run([sys.executable, str(LAUNCHER), *argv], env=env,
                                      stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                      timeout=300)
                self.assertEqual(done.returncode, 0, done.stderr[-3000:])
                line = [row for row in done.stdout.splitlines() if row.startswith("applied:")]
                self.assertEqual(len(line), 1, done.stdout)
                expected = ([cegen_primus.PATCH_ID, cegen_primus.CHECK_PATCH_ID] if applied else [])
                self.assertEqual(line[0], f"applied: {expected}")


def float64_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron-Core's loss [b, s] (the stand-in's vocab-parallel cross entropy, TP = 1) of
    the logits the model computes (``hidden @ weight.T`` in their dtype), and the output
    weight's gradient of the masked mean, in float64 from those logits on."""
    logits = torch.matmul(hidden, weight.t()).to(torch.float64).requires_grad_(True)
    loss = tp_cross_entropy.vocab_parallel_cross_entropy_impl(logits, labels.t().contiguous()).t()
    ((loss * mask.to(torch.float64)).sum() / mask.sum()).backward()
    grad = torch.einsum("sbv,sbh->vh", logits.grad, hidden.to(torch.float64))
    return loss.detach(), grad


def model_inputs(offset: int, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    hidden = S.random_logits((7, 3, 16), scale=1.0, offset=offset).to(dtype)
    weight = S.random_logits((VOCAB, 16), scale=0.25, offset=offset + 1).to(dtype)
    labels = S.random_labels((3, 7), VOCAB, offset=offset + 2)
    mask = (torch.rand((3, 7), generator=S.generator(offset + 3)) > 0.25).float()
    return {"hidden": hidden, "weight": weight, "labels": labels, "mask": mask}


def tiny_model(data: Dict[str, torch.Tensor], fusion: bool = True) -> TinyGPTModel:
    """The Megatron stand-in's GPT at TP = 1 with ``data``'s output weight."""
    config = TransformerConfig(tensor_model_parallel_size=1, cross_entropy_loss_fusion=fusion)
    groups = ProcessGroupCollection(tp=FakeProcessGroup(1), cp=FakeProcessGroup(1),
                                    pp=FakeProcessGroup(1), embd=None)
    return TinyGPTModel(config, hidden_size=16, vocab_size=VOCAB, pg_collection=groups,
                        output_weight=data["weight"].clone())


@S.requires_kernels
class TestDispatch(PrimusTestCase):
    """Switched on through Primus, the loss is cegen.megatron's dispatch: float64 numbers."""

    def test_loss_and_gradient_against_float64(self) -> None:
        self.run_primus({"use_turbo_cross_entropy": True})
        for index, dtype in enumerate((torch.float32, torch.bfloat16)):
            with self.subTest(dtype=dtype):
                data = model_inputs(100 + 10 * index, dtype)
                module = tiny_model(data)
                language_module.CALLS["compute_language_model_loss"] = 0
                with self.assertNoLogs("cegen.megatron", level="WARNING"):
                    loss = module(data["hidden"], data["labels"])
                    ((loss * data["mask"]).sum() / data["mask"].sum()).backward()
                self.assertEqual(language_module.CALLS["compute_language_model_loss"], 0,
                                 "fell back to Megatron's implementation")
                ref_loss, ref_grad = float64_reference(data["hidden"], data["weight"],
                                                       data["labels"], data["mask"])
                S.assert_close(self, loss, ref_loss, *S.LOSS_TOLERANCE[dtype], "loss")
                # The weight gradient's matmul runs in the model's dtype: in
                # bf16 its sums of rounded products may cancel, so the
                # absolute bound is bf16's rounding (2^-8) of the largest
                # entry, twice (a fixed 1e-4 failed seed 877458692 by 6.9e-4
                # at an entry of 0.01 next to entries of 0.1).
                scale = float(ref_grad.abs().max())
                tolerance = ((1e-4, 1e-6) if dtype == torch.float32
                             else (1.6e-2, 2.0 ** -7 * scale))
                S.assert_close(self, module.output_weight.grad, ref_grad, *tolerance, "weight gradient")

    def test_overwrite_input_from_the_yaml(self) -> None:
        for overwrite in (False, True):
            with self.subTest(overwrite=overwrite):
                LanguageModule.compute_language_model_loss = ORIGINAL
                self.run_primus({"use_turbo_cross_entropy": True,
                                 "turbo_ce_overwrite_input": overwrite})
                data = model_inputs(200)
                module = tiny_model(data)
                leaf = torch.matmul(data["hidden"], data["weight"].t()).requires_grad_(True)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    logits = leaf.clone()  # held by one local, as GPTModel._postprocess does
                    loss = module.compute_language_model_loss(data["labels"], logits)
                    loss.sum().backward()
                refused = [w for w in caught if issubclass(w.category, cegen.OverwriteRefusedWarning)]
                self.assertEqual(refused, [])
                self.assertEqual(bool(torch.equal(logits.detach(), leaf.grad)), overwrite,
                                 "the logits' storage holds the gradient iff overwrite is on")
                ref_loss, _ = float64_reference(data["hidden"], data["weight"], data["labels"],
                                                torch.ones(3, 7))
                S.assert_close(self, loss, ref_loss, 1e-5, 1e-5, "loss")

    def test_fallback_is_megatrons_and_logged_once(self) -> None:
        self.run_primus({"use_turbo_cross_entropy": True})
        data = model_inputs(300)
        module = tiny_model(data, fusion=False)
        language_module.CALLS["compute_language_model_loss"] = 0
        with self.assertLogs("cegen.megatron", level="WARNING") as logs:
            first = module(data["hidden"], data["labels"])
            second = module(data["hidden"], data["labels"])
        self.assertEqual(len(logs.output), 1)
        self.assertIn("cross_entropy_loss_fusion is off", logs.output[0])
        self.assertEqual(language_module.CALLS["compute_language_model_loss"], 2)
        LanguageModule.compute_language_model_loss = ORIGINAL
        self.assertTrue(torch.equal(first, module(data["hidden"], data["labels"])))
        self.assertTrue(torch.equal(first, second))


class TestPrimusTurbo(PrimusTestCase):
    """Primus-Turbo's patch of the same method: whichever runs second detects the first."""

    def test_turbo_first_cegen_replaces_it_and_says_so(self) -> None:
        turbo = turbo_standin()  # default priority 50: runs before cegen's (60)
        self.run_primus({"use_turbo_cross_entropy": True})
        self.assertEqual(len(self.records.messages), 1, self.records.messages)
        self.assertIn(cegen_primus.PRIMUS_TURBO_PATCH_ID, self.records.messages[0])
        self.assertIn("before cegen's patch", self.records.messages[0])
        self.assertTrue(cegen_primus._is_cegen_layer(current_method()))
        self.assertIs(current_method()._cegen_original, ORIGINAL, "cegen's fallback is not Megatron's")
        self.assertFalse(cegen_primus._is_primus_turbo_layer(current_method()))
        if S.kernels_missing() is None:
            data = model_inputs(400)
            tiny_model(data)(data["hidden"], data["labels"])
            self.assertEqual(turbo.CALLS["turbo"], 0, "Primus-Turbo's loss ran")

    def test_turbo_second_is_detected_by_the_check_and_removed(self) -> None:
        turbo = turbo_standin()
        register_patch(cegen_primus.PRIMUS_TURBO_PATCH_ID, backend="megatron", phase="before_train",
                       condition=turbo._enabled, priority=70)(turbo.patch_cross_entropy)
        self.run_primus({"use_turbo_cross_entropy": True})
        self.assertEqual(len(self.records.messages), 1, self.records.messages)
        self.assertIn("ran after cegen's patch", self.records.messages[0])
        self.assertTrue(cegen_primus._is_cegen_layer(current_method()))
        self.assertIs(current_method()._cegen_original, ORIGINAL)

    def test_turbo_over_cegen_carries_cegens_attributes(self) -> None:
        # functools.wraps copies __dict__: Turbo's wrapper of cegen's method has
        # _cegen_original too, so cegen tells its own layer by its code.
        turbo = turbo_standin()
        turbo_ce.install(turbo_ce.TurboCESettings(True, False), language_module_cls=LanguageModule)
        turbo.patch_cross_entropy(_context(True))
        wrapper = current_method()
        self.assertTrue(hasattr(wrapper, "_cegen_original"))
        self.assertFalse(cegen_primus._is_cegen_layer(wrapper))
        self.assertTrue(cegen_primus._is_primus_turbo_layer(wrapper))

    def test_turbo_without_wrapped_function_stays_below_cegen(self) -> None:
        def turbo_method(self: Any, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            return ORIGINAL(self, labels, logits)

        turbo_method._primus_turbo_ce = True  # type: ignore[attr-defined]
        LanguageModule.compute_language_model_loss = turbo_method
        self.run_primus({"use_turbo_cross_entropy": True})
        self.assertIn("cannot be found", self.records.messages[0])
        self.assertIs(current_method()._cegen_original, turbo_method)

    def test_check_reports_a_method_replaced_by_another_patch(self) -> None:
        def other(ctx: Any) -> None:
            LanguageModule.compute_language_model_loss = lambda self, labels, logits: None

        register_patch("megatron.other.loss", backend="megatron", phase="before_train",
                       priority=100)(other)
        self.run_primus({"use_turbo_cross_entropy": True})
        self.assertEqual(len(self.records.messages), 1)
        self.assertIn("is not in place", self.records.messages[0])

    def test_off_leaves_turbo_alone(self) -> None:
        turbo_standin()
        self.run_primus({"use_turbo_cross_entropy": True}, ["--use_turbo_cross_entropy", "false"])
        self.assertIs(current_method(), ORIGINAL)
        self.assertEqual(self.records.messages, [])


def _context(on: bool) -> Any:
    from types import SimpleNamespace

    from primus.core.patches import PatchContext

    params = SimpleNamespace(use_turbo_cross_entropy=on)
    return PatchContext(backend="megatron", phase="before_train",
                        extra={"module_config": SimpleNamespace(params=params)})


@S.requires_kernels
@unittest.skipUnless(torch.distributed.is_available() and torch.distributed.is_gloo_available(),
                     "this PyTorch has no torch.distributed with gloo")
class TestTensorParallel(unittest.TestCase):
    """TP = 2 over a gloo group: Primus's switch installs the vocab-parallel dispatch."""

    WORLD = 2

    def test_tp2_against_float64(self) -> None:
        directory = Path(tempfile.mkdtemp(prefix="cegen-primus-tp-"))
        self.addCleanup(shutil.rmtree, directory, True)
        data = model_inputs(500)
        on = experiment(str(directory), {"use_turbo_cross_entropy": True,
                                         "cross_entropy_loss_fusion": True,
                                         "tensor_model_parallel_size": self.WORLD})
        runs = {"cegen": (on, []),
                "cegen_overwrite": (on, ["--turbo_ce_overwrite_input", "true"]),
                "megatron": (on, ["--use_turbo_cross_entropy", "false"])}
        inputs = directory / "inputs.pt"
        torch.save({"spec": data, "runs": runs}, inputs)
        store = torch.distributed.TCPStore("127.0.0.1", 0, None, True,
                                           datetime.timedelta(seconds=300), wait_for_workers=False)
        outputs = [directory / f"rank{rank}.pt" for rank in range(self.WORLD)]
        logs = [open(directory / f"rank{rank}.log", "w+", encoding="utf-8")
                for rank in range(self.WORLD)]
        processes = [subprocess.Popen(
            [sys.executable, str(S.HERE / "_primus_tp_worker.py"), "--rank", str(rank),
             "--world", str(self.WORLD), "--port", str(store.port), "--inputs", str(inputs),
             "--output", str(outputs[rank]),
             "--cache-dir", str(_config.get_config().resolved_cache_dir())],
            stdin=subprocess.DEVNULL, stdout=logs[rank], stderr=subprocess.STDOUT, cwd=str(S.REPO))
            for rank in range(self.WORLD)]
        deadline = time.monotonic() + 600
        for rank, process in enumerate(processes):
            try:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in processes:
                    other.kill()
                    other.wait()
            logs[rank].seek(0)
            text = logs[rank].read()
            logs[rank].close()
            self.assertEqual(process.returncode, 0, f"rank {rank}:\n{text[-3000:]}")
        ranks = [torch.load(path) for path in outputs]
        ref_loss, ref_grad = float64_reference(data["hidden"], data["weight"], data["labels"],
                                               data["mask"])
        for run in runs:
            with self.subTest(run=run):
                for rank, result in enumerate(ranks):
                    step = result[run]
                    self.assertEqual(step["patched"], run != "megatron")
                    S.assert_close(self, step["loss"], ref_loss, 1e-5, 1e-5, f"rank {rank} loss")
                    if run != "megatron":
                        self.assertEqual(step["original_calls"], 0, f"fell back: {step['logged']}")
                        self.assertEqual(step["logged"], [])
                        self.assertEqual(step["refused"], [])
                grad = torch.cat([result[run]["grad"] for result in ranks], dim=0)
                S.assert_close(self, grad, ref_grad, 1e-4, 1e-6, "weight gradient")


def _real_primus_missing() -> Optional[str]:
    if not (REAL_PRIMUS / "primus" / "core" / "patches" / "patch_registry.py").is_file():
        return (f"no fetched Primus at {REAL_PRIMUS} (set CEGEN_PRIMUS_SRC, or export the "
                "'primus' folder of an AMD-AGI/Primus checkout there)")
    return None


@unittest.skipIf(_real_primus_missing() is not None, _real_primus_missing() or "")
class TestRealPrimus(unittest.TestCase):
    """The real registry, config loader, runtime and command line (_primus_real_check.py)."""

    @classmethod
    def setUpClass(cls) -> None:
        directory = Path(tempfile.mkdtemp(prefix="cegen-primus-real-"))
        cls.addClassCleanup(shutil.rmtree, directory, True)
        out = directory / "result.json"
        done = subprocess.run(
            [sys.executable, str(S.HERE / "_primus_real_check.py"), "--primus", str(REAL_PRIMUS),
             "--out", str(out), "--cache-dir", str(_config.get_config().resolved_cache_dir())],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600, cwd=str(S.REPO))
        if done.returncode != 0:
            raise AssertionError(f"_primus_real_check.py exited {done.returncode}:\n{done.stderr[-4000:]}")
        cls.results = json.loads(out.read_text(encoding="utf-8"))

    def scenario(self, name: str) -> Dict[str, Any]:
        result = self.results[name]
        self.assertNotIn("crash", result, result.get("crash"))
        return result

    def test_the_real_registry_holds_cegens_patches(self) -> None:
        registry = self.results["registry"]
        self.assertEqual(registry["patch"], ["megatron", "before_train", cegen_primus.PRIORITY])
        self.assertEqual(registry["check"], ["megatron", "before_train", cegen_primus.CHECK_PRIORITY])
        self.assertTrue(registry["primus_file"].startswith(str(REAL_PRIMUS.resolve())),
                        registry["primus_file"])

    def test_launcher_imports_cegens_patch_module(self) -> None:
        first = self.scenario("yaml_on")
        self.assertFalse(first["cegen_imported_before"])
        self.assertTrue(first["cegen_in_place"])

    def test_yaml_and_command_line_switch_cegen_on_and_off(self) -> None:
        expected = {"yaml_on": (True, False), "yaml_on_cli_off": (False, None),
                    "yaml_off": (False, None), "yaml_off_cli_on": (True, True),
                    "unset": (False, None), "unset_cli_on": (True, False)}
        for name, (on, overwrite) in expected.items():
            with self.subTest(scenario=name):
                result = self.scenario(name)
                self.assertNotIn("error", result)
                self.assertEqual(result["cegen_in_place"], on)
                self.assertEqual(result["unpatched"], not on)
                self.assertEqual(result["overwrite_input"], overwrite)
                if on:
                    self.assertTrue(result["wraps_original"])
                    loss = result["loss"]
                    if "skipped" not in loss:
                        self.assertEqual(loss["original_calls"], 0)
                        self.assertLess(loss["max_diff"], 1e-5)

    def test_a_bad_value_stops_the_run(self) -> None:
        result = self.scenario("yaml_bad_value")
        self.assertIn("must be true or false", result.get("error", ""))
        self.assertTrue(result["unpatched"])

    def test_primus_turbo_either_order(self) -> None:
        for name, says in (("turbo_first", "before cegen's patch"), ("turbo_second", "ran after cegen's")):
            with self.subTest(scenario=name):
                result = self.scenario(name)
                self.assertTrue(result["cegen_in_place"])
                self.assertFalse(result["turbo_in_place"])
                self.assertTrue(result["wraps_original"])
                self.assertEqual(len(result["warnings"]), 1, result["warnings"])
                self.assertIn(says, result["warnings"][0])
                if "skipped" not in result["loss"]:
                    self.assertEqual(result["turbo_calls"], 0)


if __name__ == "__main__":
    unittest.main()
