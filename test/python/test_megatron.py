"""cegen.megatron against a stand-in of Megatron-Core's LanguageModule (test/python/megatron_standin)."""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import textwrap
import unittest
import warnings
from pathlib import Path

import _support as S
import torch

import cegen
from cegen import megatron as turbo_ce
from megatron.core.fusions import fused_cross_entropy
from megatron.core.models.common.language_module import language_module
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt.gpt_model import TinyGPTModel
from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection
from megatron.core.tensor_parallel import cross_entropy as tp_cross_entropy
from megatron.core.transformer.transformer_config import TransformerConfig


def megatron_parser() -> argparse.ArgumentParser:
    """A parser built the way Megatron's parse_args builds it, before extra args."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--cross-entropy-loss-fusion", action="store_true")
    return parser


def write_yaml(directory: str, text: str) -> str:
    path = os.path.join(directory, "experiment.yaml")
    with open(path, "w", encoding="utf-8") as stream:
        stream.write(textwrap.dedent(text))
    return path


class TestArguments(unittest.TestCase):
    """add_turbo_ce_args and the defaults YAML < experiment YAML < command line order."""

    def parse(self, argv, experiment_yaml=None):  # type: ignore[no-untyped-def]
        parser = turbo_ce.add_turbo_ce_args(megatron_parser(), experiment_yaml=experiment_yaml, argv=argv)
        return parser.parse_args(argv)

    def test_defaults_are_off(self) -> None:
        args = self.parse([])
        self.assertFalse(args.use_turbo_cross_entropy)
        self.assertFalse(args.turbo_ce_overwrite_input)
        self.assertEqual(turbo_ce.load_settings(), turbo_ce.TurboCESettings(False, False))

    def test_returns_the_parser_with_an_argument_group(self) -> None:
        parser = megatron_parser()
        self.assertIs(turbo_ce.add_turbo_ce_args(parser, argv=[]), parser)
        titles = [group.title for group in parser._action_groups]
        self.assertIn("turbo cross entropy", titles)

    def test_command_line(self) -> None:
        args = self.parse(["--use-turbo-cross-entropy", "--turbo-ce-overwrite-input"])
        self.assertTrue(args.use_turbo_cross_entropy)
        self.assertTrue(args.turbo_ce_overwrite_input)

    def test_experiment_yaml_overrides_defaults_and_cli_overrides_yaml(self) -> None:
        with tempfile.TemporaryDirectory() as directory:
            path = write_yaml(directory, """
                train_iters: 10
                turbo_cross_entropy:
                  use_turbo_cross_entropy: true
                  turbo_ce_overwrite_input: true
            """)
            args = self.parse([], experiment_yaml=path)
            self.assertTrue(args.use_turbo_cross_entropy)
            self.assertTrue(args.turbo_ce_overwrite_input)
            args = self.parse(["--no-turbo-ce-overwrite-input"], experiment_yaml=path)
            self.assertTrue(args.use_turbo_cross_entropy)
            self.assertFalse(args.turbo_ce_overwrite_input)

    def test_experiment_yaml_from_the_command_line(self) -> None:
        with tempfile.TemporaryDirectory() as directory:
            path = write_yaml(directory, "use-turbo-cross-entropy: true\n")
            args = self.parse(["--turbo-ce-yaml", path])
            self.assertTrue(args.use_turbo_cross_entropy)
            self.assertFalse(args.turbo_ce_overwrite_input)
            self.assertEqual(args.turbo_ce_yaml, path)
            args = self.parse([f"--turbo-ce-yaml={path}", "--no-use-turbo-cross-entropy"])
            self.assertFalse(args.use_turbo_cross_entropy)

    def test_bad_yaml_is_a_clear_error(self) -> None:
        with tempfile.TemporaryDirectory() as directory:
            path = write_yaml(directory, "turbo_cross_entropy:\n  use_turbo_cross_entropy: 'yes'\n")
            with self.assertRaisesRegex(ValueError, "must be true or false"):
                self.parse([], experiment_yaml=path)
            path = write_yaml(directory, "turbo_cross_entropy:\n  use_turbo_ce: true\n")
            with self.assertRaisesRegex(ValueError, "unknown setting 'use_turbo_ce'"):
                self.parse([], experiment_yaml=path)
            with self.assertRaisesRegex(ValueError, "cannot read"):
                self.parse([], experiment_yaml=os.path.join(directory, "missing.yaml"))

    def test_settings_from_megatron_global_args(self) -> None:
        from megatron import training

        training.set_args(argparse.Namespace(use_turbo_cross_entropy=True, turbo_ce_overwrite_input=False))
        self.assertEqual(turbo_ce.settings_from_args(None), turbo_ce.TurboCESettings(True, False))

    def test_no_environment_variable_is_read(self) -> None:
        package = Path(cegen.__file__).parent
        for source in package.glob("*.py"):
            text = source.read_text(encoding="utf-8")
            self.assertIsNone(re.search(r"os\.environ|getenv", text), f"{source.name} reads the environment")


def make_module(tp: int = 1, fusion: bool = True, impl: str = "native", **kwargs) -> TinyGPTModel:  # type: ignore[no-untyped-def]
    config = TransformerConfig(tensor_model_parallel_size=tp, cross_entropy_loss_fusion=fusion,
                               cross_entropy_fusion_impl=impl)
    groups = ProcessGroupCollection(tp=FakeProcessGroup(tp), cp=FakeProcessGroup(1),
                                    pp=FakeProcessGroup(1), embd=None)
    torch.manual_seed(S.SEED)
    return TinyGPTModel(config, hidden_size=16, vocab_size=kwargs.pop("vocab", 97),
                        pg_collection=groups, **kwargs)


class PatchedTestCase(unittest.TestCase):
    """Installs the patch on the stand-in for each test and removes it afterwards."""

    overwrite = False

    def setUp(self) -> None:
        turbo_ce.reset_fallback_log()
        cegen.reset_overwrite_warnings()
        installed = turbo_ce.install(
            turbo_ce.TurboCESettings(use_turbo_cross_entropy=True, turbo_ce_overwrite_input=self.overwrite))
        self.assertTrue(installed)
        self.addCleanup(turbo_ce.uninstall)
        for calls in (language_module.CALLS, fused_cross_entropy.CALLS, tp_cross_entropy.CALLS):
            for key in calls:
                calls[key] = 0

    def inputs(self, seq: int = 7, batch: int = 3, vocab: int = 97):  # type: ignore[no-untyped-def]
        hidden = S.random_logits((seq, batch, 16), scale=1.0)
        labels = S.random_labels((batch, seq), vocab)
        return hidden, labels

    def original_calls(self) -> int:
        return language_module.CALLS["compute_language_model_loss"]


class TestInstall(unittest.TestCase):
    def test_off_patches_nothing(self) -> None:
        original = LanguageModule.__dict__["compute_language_model_loss"]
        self.assertFalse(turbo_ce.install(turbo_ce.TurboCESettings()))
        self.assertIs(LanguageModule.__dict__["compute_language_model_loss"], original)
        self.assertFalse(turbo_ce.is_installed())

    def test_install_and_uninstall(self) -> None:
        original = LanguageModule.__dict__["compute_language_model_loss"]
        self.assertTrue(turbo_ce.install(argparse.Namespace(use_turbo_cross_entropy=True)))
        self.assertTrue(turbo_ce.is_installed())
        self.assertTrue(turbo_ce.install(argparse.Namespace(use_turbo_cross_entropy=True)))  # idempotent
        self.assertIs(LanguageModule.__dict__["compute_language_model_loss"]._cegen_original, original)
        turbo_ce.uninstall()
        self.assertIs(LanguageModule.__dict__["compute_language_model_loss"], original)


class TestFallback(PatchedTestCase):
    """Unsupported cases call Megatron's implementation unchanged and log why, once."""

    def assert_falls_back(self, module: TinyGPTModel, hidden: torch.Tensor, labels: torch.Tensor,
                          reason: str) -> None:
        turbo_ce.uninstall()
        expected = module(hidden, labels)
        turbo_ce.install(turbo_ce.TurboCESettings(True, self.overwrite))
        before = self.original_calls()
        with self.assertLogs("cegen.megatron", level="WARNING") as logs:
            loss = module(hidden, labels)
        self.assertEqual(self.original_calls(), before + 1)
        self.assertTrue(torch.equal(loss, expected))
        self.assertEqual(len(logs.output), 1)
        self.assertRegex(logs.output[0], reason)
        with self.assertNoLogs("cegen.megatron", level="WARNING"):
            module(hidden, labels)  # the same reason is logged once
        self.assertEqual(self.original_calls(), before + 2)

    # TP > 1 runs cegen's vocab-parallel path over a real torch.distributed group
    # (test_tensor_parallel.py, in process groups); without one it falls back.

    def test_tensor_parallel_without_torch_distributed(self) -> None:
        hidden, labels = self.inputs()
        self.assert_falls_back(make_module(tp=2), hidden, labels,
                               "tensor-parallel size is 2 but torch.distributed is not initialized")

    def test_tensor_parallel_group_only(self) -> None:
        module = make_module(tp=1)
        module.tp_group = FakeProcessGroup(4)
        hidden, labels = self.inputs()
        self.assert_falls_back(module, hidden, labels,
                               "tensor-parallel size is 4 but torch.distributed is not initialized")

    def test_fusion_off(self) -> None:
        hidden, labels = self.inputs()
        self.assert_falls_back(make_module(fusion=False), hidden, labels, "cross_entropy_loss_fusion is off")
        self.assertGreater(tp_cross_entropy.CALLS["vocab_parallel_cross_entropy"], 0)

    def test_unsupported_dtype(self) -> None:
        module = make_module(dtype=torch.float64)
        hidden, labels = self.inputs()
        self.assert_falls_back(module, hidden.double(), labels, "dtype torch.float64 is not supported")

    def test_unsupported_label_dtype(self) -> None:
        hidden, labels = self.inputs()
        self.assert_falls_back(make_module(), hidden, labels.to(torch.int16), "labels dtype torch.int16")


@S.requires_kernels
class TestSupported(PatchedTestCase):
    """TP size 1, fusion on, supported dtype: cegen computes the loss."""

    def test_matches_megatron_contract(self) -> None:
        for impl in ("native", "te"):  # 'te' would raise here without TransformerEngine
            with self.subTest(impl=impl):
                module = make_module(impl=impl)
                hidden, labels = self.inputs()
                before = self.original_calls()
                with S.recorded_descriptors() as records:
                    loss = module(hidden, labels)
                self.assertEqual(self.original_calls(), before, "fell back to Megatron's implementation")
                self.assertEqual(loss.dtype, torch.float32)
                self.assertEqual(tuple(loss.shape), (3, 7))
                self.assertTrue(loss.is_contiguous())
                labels_seen = [r for r in records if r[0] == "labels"][0]
                self.assertEqual(labels_seen[2], tuple(labels.stride()), "labels were transposed")
                self.assertEqual(labels_seen[3], labels.data_ptr(), "labels were copied")
                logits = torch.matmul(hidden, module.output_weight.detach().t())
                ref_loss, _ = S.reference(logits, labels, label_layout="bs")
                S.assert_close(self, loss, ref_loss, 1e-5, 1e-5, "loss")

    def test_gradients_match_megatrons_implementation(self) -> None:
        module = make_module(dtype=torch.float32)
        hidden, labels = self.inputs()
        mask = (torch.rand(labels.shape, generator=S.generator(21)) > 0.25).float()
        loss = module(hidden, labels)
        ((loss * mask).sum() / mask.sum()).backward()
        ours = module.output_weight.grad.clone()
        module.output_weight.grad = None
        turbo_ce.uninstall()
        reference = module(hidden, labels)
        ((reference * mask).sum() / mask.sum()).backward()
        S.assert_close(self, loss, reference, 1e-5, 1e-5, "loss")
        S.assert_close(self, ours, module.output_weight.grad, 1e-4, 1e-6, "weight gradient")

    def test_bf16(self) -> None:
        module = make_module(dtype=torch.bfloat16)
        hidden, labels = self.inputs()
        before = self.original_calls()
        loss = module(hidden.to(torch.bfloat16), labels)
        self.assertEqual(self.original_calls(), before)
        self.assertEqual(loss.dtype, torch.float32)
        loss.sum().backward()
        self.assertEqual(module.output_weight.grad.dtype, torch.bfloat16)


@S.requires_kernels
class TestOverwriteInMegatron(PatchedTestCase):
    """--turbo-ce-overwrite-input through GPTModel._postprocess's call structure."""

    overwrite = True

    def test_overwrite_honored_for_megatrons_caller(self) -> None:
        module = make_module()
        hidden, labels = self.inputs()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = module(hidden, labels)
            loss.mean().backward()
        refused = [str(w.message) for w in caught if issubclass(w.category, cegen.OverwriteRefusedWarning)]
        self.assertEqual(refused, [])
        ours = module.output_weight.grad.clone()
        module.output_weight.grad = None
        turbo_ce.uninstall()
        module(hidden, labels).mean().backward()
        S.assert_close(self, ours, module.output_weight.grad, 1e-4, 1e-6, "weight gradient")

    def test_caller_keeping_another_reference_is_refused(self) -> None:
        module = make_module()
        hidden, labels = self.inputs()
        logits = torch.matmul(hidden, module.output_weight.t())
        kept = [logits]  # a second holder besides the caller's variable
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module.compute_language_model_loss(labels, logits).sum().backward()
        refused = [str(w.message) for w in caught if issubclass(w.category, cegen.OverwriteRefusedWarning)]
        self.assertEqual(len(refused), 1)
        self.assertIn("another Python reference", refused[0])
        self.assertIs(kept[0], logits)


if __name__ == "__main__":
    unittest.main()
