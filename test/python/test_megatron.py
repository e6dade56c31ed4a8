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
from typing import List, Tuple

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
from transformer_engine.pytorch import cross_entropy as te_cross_entropy


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

    def test_yaml_that_is_not_utf8_names_the_file(self) -> None:
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "latin1.yaml")
            with open(path, "wb") as stream:  # "# Einstellungen für" in Latin-1: byte 0xfc
                stream.write(b"# Einstellungen f\xfcr cegen\nuse_turbo_cross_entropy: true\n")
            with self.assertRaises(cegen.InvalidInputError) as caught:
                self.parse([], experiment_yaml=path)
            message = str(caught.exception)
            self.assertIn(path, message)
            self.assertIn("not UTF-8", message)
            self.assertIn("byte 0xfc at offset 17", message)
            self.assertIsInstance(caught.exception, ValueError)
            self.assertNotIsInstance(caught.exception, UnicodeDecodeError)

    def test_yaml_errors_are_cegen_errors(self) -> None:
        with tempfile.TemporaryDirectory() as directory:
            cases = {"use_turbo_cross_entropy: [1, 2\n": "is not valid YAML",
                     "- a list\n": "expected a mapping at the top level",
                     "use_turbo_cross_entropy: 1\n": "must be true or false"}
            for text, message in cases.items():
                with self.subTest(text=text):
                    path = write_yaml(directory, text)
                    with self.assertRaisesRegex(cegen.InvalidInputError, re.escape(message)) as caught:
                        self.parse([], experiment_yaml=path)
                    self.assertIn(path, str(caught.exception))
            with self.assertRaisesRegex(cegen.InvalidInputError, "cannot read .*" + re.escape(directory)):
                self.parse([], experiment_yaml=directory)  # a directory, not a file

    def test_settings_namespace_holds_flags_only(self) -> None:
        # A hand-made namespace with the string "false" must not turn the patch on.
        for value in ("false", "False", 0, None, 1):
            with self.subTest(value=value):
                with self.assertRaisesRegex(cegen.InvalidInputError,
                                            "args.use_turbo_cross_entropy must be True or False"):
                    turbo_ce.settings_from_args(argparse.Namespace(use_turbo_cross_entropy=value))

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
        for calls in (language_module.CALLS, fused_cross_entropy.CALLS, tp_cross_entropy.CALLS,
                      te_cross_entropy.CALLS):
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
        for impl in ("native", "te"):
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


def megatron_reference(logits: torch.Tensor, labels: torch.Tensor, grad_loss: torch.Tensor,
                       impl: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The loss [b, s] and d(sum grad_loss * loss)/d(logits) that cegen must give for
    ``cross_entropy_fusion_impl=impl``, in float64: Megatron-Core's (the stand-in's on
    float64 logits) for every label; with ``te`` TE's loss 0 and zero gradient for -100."""
    x = logits.detach().to(torch.float64).requires_grad_(True)
    loss = tp_cross_entropy.vocab_parallel_cross_entropy_impl(x, labels.t().contiguous()).t()
    if impl == "te":
        loss = torch.where(labels == -100, torch.zeros_like(loss), loss)
    (loss * grad_loss.to(torch.float64)).sum().backward()
    return loss.detach(), x.grad


def refusals(caught) -> List[str]:  # type: ignore[no-untyped-def]
    return [str(w.message) for w in caught if issubclass(w.category, cegen.OverwriteRefusedWarning)]


@S.requires_kernels
class TestSFTLabels(PatchedTestCase):
    """Megatron's SFT labels: -100 prompt tokens masked by loss_mask, and any other id.

    Megatron-Core's loss accepts every label (one outside [0, V) gets lse - max and a
    softmax gradient); TE's ignores -100. The patch must not raise and must give those
    numbers (docs/megatron.md, "Labels").
    """

    VOCAB = 97

    def direct(self, module: TinyGPTModel, labels: torch.Tensor, logits: torch.Tensor,
               upstream: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[str]]:
        """compute_language_model_loss called as GPTModel._postprocess calls it: on a
        non-leaf held by one local variable. Returns loss, d/dlogits, the logits' storage
        afterwards and the overwrite refusals."""
        leaf = logits.clone().requires_grad_(True)
        cegen.reset_overwrite_warnings()
        with warnings.catch_warnings(record=True) as caught, cegen._kernels.poison_outputs():
            warnings.simplefilter("always")
            y = leaf.clone()
            loss = module.compute_language_model_loss(labels, y)
            (loss * upstream).sum().backward()
        return loss.detach(), leaf.grad, y.detach(), refusals(caught)

    def test_per_token_loss_and_gradient(self) -> None:
        index = 0
        for impl in ("native", "te"):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for label_dtype in (torch.int64, torch.int32):
                    index += 1
                    with self.subTest(impl=impl, dtype=dtype, labels=label_dtype):
                        self.check_direct(impl, dtype, label_dtype, offset=100 * index)

    def check_direct(self, impl: str, dtype: torch.dtype, label_dtype: torch.dtype,
                     offset: int) -> None:
        module = make_module(impl=impl, dtype=dtype)
        logits = S.random_logits((7, 3, self.VOCAB), dtype, offset=offset)
        labels = S.sft_labels((3, 7), self.VOCAB, label_dtype, offset=offset + 1)
        upstream = torch.rand((3, 7), generator=S.generator(offset + 2)) + 0.25
        before = self.original_calls()
        with self.assertNoLogs("cegen.megatron", level="WARNING"):
            loss, grad, storage, refused = self.direct(module, labels, logits, upstream)
        self.assertEqual(self.original_calls(), before, "fell back to Megatron's implementation")
        self.assertEqual((loss.dtype, tuple(loss.shape)), (torch.float32, (3, 7)))
        self.assertTrue(bool(torch.isfinite(loss).all()), f"non-finite loss (seed={S.SEED})")
        ref_loss, ref_grad = megatron_reference(logits, labels, upstream, impl)
        S.assert_close(self, loss, ref_loss, *S.LOSS_TOLERANCE[dtype], f"{impl} loss")
        S.assert_close(self, grad, ref_grad, *S.GRAD_TOLERANCE[dtype], f"{impl} gradient")
        ignored = labels == -100
        if impl == "te":
            self.assertTrue(bool((loss[ignored] == 0).all()))
            self.assertTrue(bool((grad.transpose(0, 1)[ignored] == 0).all()), "-100 rows not zero")
        else:  # Core: -100 is just another id outside the vocabulary
            self.assertTrue(bool((loss[ignored] > 0).all()))
        self.assertEqual(refused, [])
        self.assertEqual(bool(torch.equal(storage, grad)), self.overwrite,
                         "the logits' storage holds the gradient iff overwrite-input is on")

    def test_loss_mask_reduction_matches_megatron(self) -> None:
        # The SFT training step: the loss mask zeroes the prompt (-100) and every other
        # token whose label is not a vocabulary id; the masked mean and the output layer's
        # weight gradient equal Megatron-Core's.
        for index, impl in enumerate(("native", "te")):
            with self.subTest(impl=impl):
                module = make_module(impl=impl)
                hidden, _ = self.inputs()
                labels = S.sft_labels((3, 7), self.VOCAB, offset=1000 + index)
                mask = ((labels >= 0) & (labels < self.VOCAB)).float()
                before = self.original_calls()
                loss = module(hidden, labels)
                ((loss * mask).sum() / mask.sum()).backward()
                self.assertEqual(self.original_calls(), before)
                ours = module.output_weight.grad.clone()
                module.output_weight.grad = None
                turbo_ce.uninstall()
                try:
                    module.config.cross_entropy_fusion_impl = "native"  # Core's numbers
                    reference = module(hidden, labels)
                    total = (reference * mask).sum() / mask.sum()
                    total.backward()
                    module.config.cross_entropy_fusion_impl = "te"
                    te_loss = module(hidden, labels).detach()  # TE's own (the stand-in's)
                finally:
                    turbo_ce.install(turbo_ce.TurboCESettings(True, self.overwrite))
                S.assert_close(self, (loss * mask).sum() / mask.sum(), total, 1e-5, 1e-5, "masked mean")
                kept = labels != -100 if impl == "te" else torch.ones_like(mask, dtype=torch.bool)
                S.assert_close(self, loss[kept], reference[kept], 1e-5, 1e-5, "per-token loss")
                S.assert_close(self, ours, module.output_weight.grad, 1e-4, 1e-6, "weight gradient")
                # TE's own loss is +inf for the ids outside [0, V) that are not -100, and a
                # loss mask of 0 turns that into NaN: why cegen keeps Core's values there.
                self.assertTrue(bool(torch.isinf(te_loss[(mask == 0) & (labels != -100)]).all()))
                self.assertTrue(bool(torch.isnan((te_loss * mask).sum())))

    def test_te_equals_transformer_engine_on_prompt_masked_labels(self) -> None:
        # Real SFT batches: -100 and vocabulary ids only. TE's loss and gradient (-100 rows
        # zero even under a non-zero upstream gradient) are what the patch gives.
        module = make_module(impl="te")
        logits = S.random_logits((7, 3, self.VOCAB), offset=1100)
        labels = S.sft_labels((3, 7), self.VOCAB, offset=1101)
        labels = torch.where((labels < 0) & (labels != -100), torch.full_like(labels, 3), labels)
        labels = torch.where(labels >= self.VOCAB, torch.full_like(labels, 5), labels)
        upstream = torch.rand((3, 7), generator=S.generator(1102)) + 0.25
        loss, grad, _, _ = self.direct(module, labels, logits, upstream)
        turbo_ce.uninstall()
        calls = te_cross_entropy.CALLS["parallel_cross_entropy"]
        te_loss, te_grad, _, _ = self.direct(module, labels, logits.double(), upstream)  # float64
        self.assertEqual(te_cross_entropy.CALLS["parallel_cross_entropy"], calls + 1)
        S.assert_close(self, loss, te_loss, 1e-5, 1e-5, "loss vs TE")
        S.assert_close(self, grad, te_grad, *S.GRAD_TOLERANCE[torch.float32], "gradient vs TE")
        self.assertTrue(bool((loss[labels == -100] == 0).all()))

    def test_plain_cross_entropy_still_raises(self) -> None:
        # The contract of the public API is unchanged: only the patch opts in.
        logits = S.random_logits((7, 3, self.VOCAB))
        labels = S.sft_labels((3, 7), self.VOCAB)
        with self.assertRaises(cegen.LabelOutOfRangeError):
            cegen.cross_entropy(logits, labels)
        loss = cegen.cross_entropy(logits, labels, label_out_of_range="megatron")
        ref_loss, _ = megatron_reference(logits, labels, torch.ones((3, 7)), "native")
        S.assert_close(self, loss, ref_loss, 1e-5, 1e-5, "loss")


@S.requires_kernels
class TestSFTLabelsOverwrite(TestSFTLabels):
    """The same with --turbo-ce-overwrite-input."""

    overwrite = True


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
