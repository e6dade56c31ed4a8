"""cegen.torchtitan against a stand-in of TorchTitan v0.2.2 (test/python/torchtitan_standin).

The stand-in has TorchTitan's loss module (sum reduction, ignore index -100, its builder),
its TrainSpec registry, the JobConfig sections the loss reads and the trainer's
``forward_backward_step``. Checked: the TrainSpec registration and the job config section;
the loss and gradient on ``[B, S, V]`` and ``[T, V]`` logits against float64 (bf16, fp16,
fp32; int64 and int32 labels; ignored tokens), read in place; the reduction TorchTitan's own
loss uses (sum, and mean as in v0.1 to v0.2.1), found by the probe; training steps through
the trainer with cegen's spec against TorchTitan's; overwrite-input honored for the
trainer's call and refused for a caller that keeps the logits; the logged-once fallback to
TorchTitan's loss (DTensor-like subclasses, dtypes, shapes, a failed probe).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import unittest
import warnings
from typing import Any, Dict, List, Tuple

import _support as S

sys.path.insert(0, str(S.HERE / "torchtitan_standin"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cegen  # noqa: E402
from cegen import torchtitan as cegen_titan  # noqa: E402
from torchtitan.components import loss as titan_loss  # noqa: E402
from torchtitan.config import JobConfig, with_custom  # noqa: E402
from torchtitan.protocols import train_spec as titan_spec  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402

VOCAB = 97


class DTensor(torch.Tensor):
    """A torch.Tensor subclass named like torch's DTensor (this PyTorch may have none)."""


def reference(pred: torch.Tensor, labels: torch.Tensor, reduction: str = "sum"
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """TorchTitan's loss in float64 and its gradient w.r.t. ``pred``."""
    x = pred.detach().to(torch.float64).requires_grad_(True)
    loss = F.cross_entropy(x.reshape(-1, x.shape[-1]), labels.reshape(-1).long(),
                           reduction=reduction, ignore_index=titan_loss.IGNORE_INDEX)
    loss.backward()
    return loss.detach(), x.grad


def labels_with_ignored(shape: Tuple[int, ...], dtype: torch.dtype = torch.int64,
                        offset: int = 1) -> torch.Tensor:
    labels = S.random_labels(shape, VOCAB, offset=offset)
    labels[torch.rand(shape, generator=S.generator(offset + 7)) < 0.25] = titan_loss.IGNORE_INDEX
    return labels.to(dtype)


def job_config(**cegen_section: Any) -> Any:
    """A JobConfig with the ``cegen`` section (``--job.custom_config_module cegen.torchtitan``)."""
    config = with_custom("cegen.torchtitan")()
    for key, value in cegen_section.items():
        setattr(config.cegen, key, value)
    return config


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class TitanTestCase(unittest.TestCase):
    def setUp(self) -> None:
        cegen_titan.reset_fallback_log()
        cegen.reset_overwrite_warnings()
        titan_loss.CALLS["cross_entropy_loss"] = 0
        saved = dict(titan_spec._extra_train_specs)
        self.addCleanup(lambda: (titan_spec._extra_train_specs.clear(),
                                 titan_spec._extra_train_specs.update(saved)))
        self.records = Records()
        logging.getLogger("cegen.torchtitan").addHandler(self.records)
        self.addCleanup(logging.getLogger("cegen.torchtitan").removeHandler, self.records)


class TestTrainSpec(TitanTestCase):
    def test_register_train_spec(self) -> None:
        name = cegen_titan.register_train_spec("llama3")
        self.assertEqual(name, "llama3_cegen")
        ours, theirs = titan_spec.get_train_spec(name), titan_spec.get_train_spec("llama3")
        self.assertIs(ours.build_loss_fn, cegen_titan.build_cross_entropy_loss)
        self.assertIs(theirs.build_loss_fn, titan_loss.build_cross_entropy_loss)
        for field in dataclasses.fields(ours):
            if field.name != "build_loss_fn":
                self.assertIs(getattr(ours, field.name), getattr(theirs, field.name), field.name)
        self.assertEqual(cegen_titan.register_train_spec("llama3"), name)  # idempotent
        cegen_titan.register_train_spec("llama3", name="llama3")  # replaces the built-in
        self.assertIs(titan_spec.get_train_spec("llama3").build_loss_fn,
                      cegen_titan.build_cross_entropy_loss)

    def test_the_trainer_builds_cegens_loss_from_the_spec(self) -> None:
        config = JobConfig()
        config.model.name = "llama3_cegen"
        config.experimental.custom_import = "_titan_specs"
        sys.modules.pop("_titan_specs", None)
        trainer = Trainer(config)
        self.assertTrue(hasattr(trainer.loss_fn, "_cegen_fallback"))
        self.assertEqual(trainer.loss_fn._cegen_reduction, "sum")
        self.assertFalse(trainer.loss_fn._cegen_overwrite_input)

    def test_job_config_section(self) -> None:
        self.assertFalse(job_config().cegen.overwrite_input)
        self.assertTrue(cegen_titan.build_cross_entropy_loss(job_config(overwrite_input=True))
                        ._cegen_overwrite_input)
        self.assertFalse(cegen_titan.build_cross_entropy_loss(JobConfig())._cegen_overwrite_input)
        self.assertTrue(cegen_titan.build_cross_entropy_loss(JobConfig(), overwrite_input=True)
                        ._cegen_overwrite_input)
        with self.assertRaisesRegex(ValueError, "must be true or false"):
            cegen_titan.build_cross_entropy_loss(job_config(overwrite_input="yes"))

    def test_probe_finds_torchtitans_reduction(self) -> None:
        def mean_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # v0.2.1's
            return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

        def odd_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1),
                                   reduction="sum", ignore_index=-1)

        for function, expected in ((titan_loss.cross_entropy_loss, "sum"), (mean_loss, "mean"),
                                   (odd_loss, None)):
            with self.subTest(function=function.__name__):
                saved = titan_loss.cross_entropy_loss
                titan_loss.cross_entropy_loss = function
                try:
                    built = cegen_titan.build_cross_entropy_loss(JobConfig())
                finally:
                    titan_loss.cross_entropy_loss = saved
                self.assertEqual(built._cegen_reduction, expected)


@S.requires_kernels
class TestLoss(TitanTestCase):
    """The loss against float64, read in place."""

    def check(self, pred: torch.Tensor, labels: torch.Tensor, reduction: str = "sum") -> None:
        loss_fn = cegen_titan.build_cross_entropy_loss(JobConfig())
        titan_loss.CALLS["cross_entropy_loss"] = 0  # the build's probe called it once
        x = pred.detach().clone().requires_grad_(True)
        with S.recorded_descriptors() as records, self.assertNoLogs("cegen.torchtitan", "WARNING"):
            loss = loss_fn(x, labels)
        loss.backward()
        self.assertEqual(titan_loss.CALLS["cross_entropy_loss"], 0, "fell back")
        self.assertEqual((loss.dtype, tuple(loss.shape)), (torch.float32, ()))
        ref_loss, ref_grad = reference(pred, labels, reduction)
        S.assert_close(self, loss, ref_loss, 1e-5, 1e-4, "loss")
        S.assert_close(self, x.grad, ref_grad, *S.GRAD_TOLERANCE[pred.dtype], "gradient")
        seen = {name: (strides, pointer) for name, _, strides, pointer in records}
        self.assertEqual(seen["logits"], (tuple(x.stride()), x.data_ptr()), "logits were copied")
        self.assertEqual(seen["labels"], (tuple(labels.stride()), labels.data_ptr()),
                         "labels were copied")

    def test_bsv_logits_every_dtype(self) -> None:
        index = 0
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for label_dtype in (torch.int64, torch.int32):
                index += 1
                with self.subTest(dtype=dtype, labels=label_dtype):
                    pred = S.random_logits((3, 7, VOCAB), dtype, offset=100 * index)
                    self.check(pred, labels_with_ignored((3, 7), label_dtype, 100 * index + 1))

    def test_flat_and_strided_logits(self) -> None:
        self.check(S.random_logits((21, VOCAB), offset=900), labels_with_ignored((21,), offset=901))
        # A [B, S, V] view of [S, B, V] storage (the first two dimensions transposed).
        pred = S.random_logits((7, 3, VOCAB), offset=910).transpose(0, 1)
        labels = labels_with_ignored((7, 3), offset=911).transpose(0, 1)
        self.check(pred, labels)

    def test_mean_reduction_of_older_torchtitan(self) -> None:
        saved = titan_loss.cross_entropy_loss
        titan_loss.cross_entropy_loss = lambda p, y: F.cross_entropy(p.flatten(0, 1).float(),
                                                                     y.flatten(0, 1))
        self.addCleanup(setattr, titan_loss, "cross_entropy_loss", saved)
        self.check(S.random_logits((3, 7, VOCAB), offset=920), labels_with_ignored((3, 7), offset=921),
                   reduction="mean")

    def test_no_grad_and_bad_labels(self) -> None:
        loss_fn = cegen_titan.build_cross_entropy_loss(JobConfig())
        pred = S.random_logits((3, 7, VOCAB), offset=930)
        labels = labels_with_ignored((3, 7), offset=931)
        with torch.no_grad():
            loss = loss_fn(pred, labels)
        S.assert_close(self, loss, reference(pred, labels)[0], 1e-5, 1e-4, "loss")
        labels[1, 2] = VOCAB  # PyTorch's cross entropy raises for it too
        with self.assertRaises(cegen.LabelOutOfRangeError):
            loss_fn(pred, labels)


class TestFallback(TitanTestCase):
    """Unsupported cases run TorchTitan's own loss, the reason logged once."""

    def check(self, pred: torch.Tensor, labels: torch.Tensor, reason: str) -> None:
        loss_fn = cegen_titan.build_cross_entropy_loss(JobConfig())
        titan_loss.CALLS["cross_entropy_loss"] = 0  # the build's probe called it once
        for call in range(2):
            loss = loss_fn(pred, labels)
            self.assertEqual(titan_loss.CALLS["cross_entropy_loss"], call + 1)
        self.assertEqual(len(self.records.messages), 1, self.records.messages)
        self.assertIn(reason, self.records.messages[0])
        self.assertTrue(torch.equal(loss, titan_loss.cross_entropy_loss(pred, labels)))

    def test_dtensor_like_subclass(self) -> None:
        pred = S.random_logits((3, 7, VOCAB), offset=1000).as_subclass(DTensor)
        self.check(pred, labels_with_ignored((3, 7), offset=1001), "DTensor, a torch.Tensor subclass")

    def test_unsupported_dtypes_and_shapes(self) -> None:
        labels = labels_with_ignored((3, 7), offset=1011)
        cases = [(S.random_logits((3, 7, VOCAB), torch.float64, offset=1010), labels,
                  "logits dtype torch.float64"),
                 (S.random_logits((3, 7, VOCAB), offset=1012), labels.to(torch.int16),
                  "labels dtype torch.int16"),
                 (S.random_logits((3, 7, VOCAB), offset=1013), labels[:, :6], "are not [B, S, V]")]
        for pred, case_labels, reason in cases:
            with self.subTest(reason=reason):
                cegen_titan.reset_fallback_log()
                self.records.messages.clear()
                if case_labels.dtype == torch.int64 and case_labels.shape == labels.shape:
                    self.check(pred, case_labels, reason)
                    continue
                # TorchTitan's own loss raises for these; it is what runs.
                loss_fn = cegen_titan.build_cross_entropy_loss(JobConfig())
                titan_loss.CALLS["cross_entropy_loss"] = 0
                with self.assertRaises((ValueError, RuntimeError)):
                    loss_fn(pred, case_labels)
                self.assertEqual(titan_loss.CALLS["cross_entropy_loss"], 1)
                self.assertIn(reason, self.records.messages[0])

    def test_a_failed_probe_falls_back_always(self) -> None:
        def odd_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1),
                                   reduction="sum", label_smoothing=0.1)

        saved = titan_loss.cross_entropy_loss
        titan_loss.cross_entropy_loss = odd_loss  # TorchTitan's builder returns it too
        try:
            loss_fn = cegen_titan.build_cross_entropy_loss(JobConfig())
        finally:
            titan_loss.cross_entropy_loss = saved
        pred, labels = S.random_logits((3, 7, VOCAB), offset=1020), S.random_labels((3, 7), VOCAB)
        self.assertTrue(torch.equal(loss_fn(pred, labels), odd_loss(pred, labels)))
        self.assertEqual(len(self.records.messages), 1)
        self.assertIn("an unknown reduction, ignore index or option", self.records.messages[0])


def batches(count: int, offset: int) -> List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
    return [({"input": S.random_labels((2, 16), VOCAB, offset=offset + 2 * i)},
             labels_with_ignored((2, 16), offset=offset + 2 * i + 1)) for i in range(count)]


@S.requires_kernels
class TestTrainer(TitanTestCase):
    """TorchTitan's trainer (stand-in) with the cegen spec against TorchTitan's own."""

    def trainer(self, name: str, config: Any = None) -> Trainer:
        config = config or JobConfig()
        config.model.name = name
        config.experimental.custom_import = "_titan_specs"
        sys.modules.pop("_titan_specs", None)
        titan_spec._extra_train_specs.pop("llama3_cegen", None)
        torch.manual_seed(S.SEED)
        return Trainer(config)

    def test_training_steps_match_torchtitans_loss(self) -> None:
        ours, theirs = self.trainer("llama3_cegen"), self.trainer("llama3")
        titan_loss.CALLS["cross_entropy_loss"] = 0  # the build's probe called it once
        self.assertEqual(str(ours.model_parts[0].state_dict()), str(theirs.model_parts[0].state_dict()))
        data = batches(8, 2000)
        for step in range(4):
            microbatches = data[2 * step:2 * step + 2]  # gradient accumulation over two
            with self.assertNoLogs("cegen.torchtitan", "WARNING"):
                loss = ours.train_step(microbatches)
            expected = theirs.train_step(microbatches)
            self.assertAlmostEqual(loss, expected, delta=1e-5 * max(1.0, abs(expected)))
            for (name, a), b in zip(ours.model_parts[0].named_parameters(),
                                    theirs.model_parts[0].parameters()):
                S.assert_close(self, a, b, 1e-5, 1e-6, f"step {step} {name}")
        self.assertEqual(titan_loss.CALLS["cross_entropy_loss"], 4 * 2, "only the reference's calls")

    def test_overwrite_honored_for_the_trainers_call(self) -> None:
        trainer = self.trainer("llama3_cegen", job_config(overwrite_input=True))
        reference_trainer = self.trainer("llama3")
        pointers: Dict[str, List[int]] = {"output": [], "grad": []}

        def record(module: Any, inputs: Any, output: torch.Tensor) -> None:
            pointers["output"].append(output.data_ptr())  # no reference to the output kept
            output.register_hook(lambda grad: pointers["grad"].append(grad.data_ptr()))

        trainer.model_parts[0].output.register_forward_hook(record)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train_step(batches(2, 2100))
        reference_trainer.train_step(batches(2, 2100))
        refused = [str(w.message) for w in caught if issubclass(w.category, cegen.OverwriteRefusedWarning)]
        self.assertEqual(refused, [])
        self.assertEqual(pointers["grad"], pointers["output"], "the gradient is not in the logits' storage")
        for a, b in zip(trainer.model_parts[0].parameters(), reference_trainer.model_parts[0].parameters()):
            S.assert_close(self, a, b, 1e-5, 1e-6, "parameters after a step")

    def test_overwrite_refused_for_a_caller_that_keeps_the_logits(self) -> None:
        trainer = self.trainer("llama3_cegen", job_config(overwrite_input=True))
        model, loss_fn = trainer.model_parts[0], trainer.loss_fn
        (inputs, labels), = batches(1, 2200)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pred = model(inputs["input"])  # kept: this caller is not TorchTitan's trainer
            loss_fn(pred, labels).backward()
        refused = [str(w.message) for w in caught if issubclass(w.category, cegen.OverwriteRefusedWarning)]
        self.assertEqual(len(refused), 1, refused)
        self.assertIn("another Python reference", refused[0])
        self.assertFalse(torch.isnan(pred).any())
        kept_logits = pred.detach().clone()
        cegen.reset_overwrite_warnings()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_fn(model(inputs["input"]), labels).backward()  # a temporary: honored
        self.assertEqual([w for w in caught if issubclass(w.category, cegen.OverwriteRefusedWarning)], [])
        self.assertTrue(torch.equal(pred.detach(), kept_logits), "the kept logits changed")


if __name__ == "__main__":
    unittest.main()
