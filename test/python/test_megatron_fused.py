"""cegen.megatron's fused gradient (--turbo-ce-fused-gradient) in a Megatron-Core training
step, on the stand-in (test/python/megatron_standin).

A step here is Megatron's: the model's forward with ``loss_mask``, pretrain_gpt.py's
``loss_func`` (sum of ``losses * loss_mask``, the token count), the schedule's division by
the token count and the micro-batches (``forward_step_calc_loss``), the optimizer's loss
scale and the backward (``backward_step``). Every gradient is compared with the same step
under Megatron's own loss (the patch removed); where the prediction holds, the upstream
gradient that reaches cegen must equal it bitwise on every unmasked token; where it does
not (another loss_func), the gradients must still be right.
"""

from __future__ import annotations

import functools
import unittest
from typing import Any, Callable, Dict, List, Optional, Tuple
from unittest import mock

import _support as S
import torch

from cegen import _rescale
from cegen import megatron as turbo_ce
from megatron.core import num_microbatches_calculator
from megatron.core.models.gpt.gpt_model import TinyGPTModel
from megatron.core.pipeline_parallel import schedules
from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, BATCH, HIDDEN, VOCAB = 9, 3, 16, 97


def pretrain_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):  # type: ignore[no-untyped-def]
    """pretrain_gpt.py's loss_func (the default branch)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def weighted_loss_func(weights: torch.Tensor, loss_mask: torch.Tensor, output_tensor: torch.Tensor):  # type: ignore[no-untyped-def]
    """A user's loss_func with per-token weights: not what the prediction assumes."""
    loss, num_tokens, report = pretrain_loss_func(loss_mask * weights, output_tensor)
    return loss, num_tokens, report


def legacy_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):  # type: ignore[no-untyped-def]
    """A two-value loss_func (an averaged loss): the schedule divides by micro-batches only."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    return torch.sum(losses * loss_mask) / loss_mask.sum(), {}


class Spy:
    """Records (weights, upstream gradient) of every fused rescale."""

    def __init__(self) -> None:
        self.calls: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.original = _rescale.rescale_fused_gradient

    def __call__(self, grad, weights, grad_loss, layout, bundle=None):  # type: ignore[no-untyped-def]
        self.calls.append((weights.detach().clone(), grad_loss.detach().clone()))
        return self.original(grad, weights, grad_loss, layout, bundle)


class StepTestCase(unittest.TestCase):
    def make_model(self, per_token: bool = False, scale: Optional[float] = None,
                   dtype: torch.dtype = torch.float32) -> TinyGPTModel:
        scale_tensor = None if scale is None else torch.tensor([scale])
        config = TransformerConfig(
            cross_entropy_loss_fusion=True, calculate_per_token_loss=per_token,
            grad_scale_func=None if scale is None else (lambda loss: scale_tensor * loss))
        groups = ProcessGroupCollection(tp=FakeProcessGroup(1), cp=FakeProcessGroup(1),
                                        pp=FakeProcessGroup(1), embd=None)
        weight = (torch.randn((VOCAB, HIDDEN), generator=S.generator(600), dtype=torch.float64)
                  / HIDDEN ** 0.5).to(dtype)
        return TinyGPTModel(config, hidden_size=HIDDEN, vocab_size=VOCAB, pg_collection=groups,
                            dtype=dtype, output_weight=weight)

    def inputs(self, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
        mask = (torch.rand((BATCH, SEQ), generator=S.generator(601)) > 0.3).float()
        mask[0, 0] = 1.0
        return {"hidden": S.random_logits((SEQ, BATCH, HIDDEN), dtype, scale=1.0, offset=602),
                "labels": S.random_labels((BATCH, SEQ), VOCAB, offset=603), "mask": mask}

    def step(self, model: TinyGPTModel, data: Dict[str, torch.Tensor], micro_batches: int,
             loss_func: Callable[..., Any] = pretrain_loss_func) -> Tuple[torch.Tensor, ...]:
        hidden = data["hidden"].clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        num_microbatches_calculator.set_num_microbatches(micro_batches)
        output = model(hidden, data["labels"], loss_mask=data["mask"])
        loss, _ = schedules.forward_step_calc_loss(
            output, functools.partial(loss_func, data["mask"]), model.config, micro_batches)
        schedules.backward_step(loss, model.config)
        return output.detach(), hidden.grad, model.output_weight.grad

    def megatron_step(self, *args, **kwargs) -> Tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
        turbo_ce.uninstall()
        try:
            return self.step(*args, **kwargs)
        finally:
            self.install()

    def install(self, overwrite: bool = False, fused: bool = True) -> None:
        turbo_ce.install(turbo_ce.TurboCESettings(use_turbo_cross_entropy=True,
                                                  turbo_ce_overwrite_input=overwrite,
                                                  turbo_ce_fused_gradient=fused))

    def setUp(self) -> None:
        self.install()
        self.addCleanup(turbo_ce.uninstall)
        self.addCleanup(num_microbatches_calculator.set_num_microbatches, 1)

    def assert_same_step(self, ours: Tuple[torch.Tensor, ...], theirs: Tuple[torch.Tensor, ...],
                         dtype: torch.dtype = torch.float32) -> None:
        # atol relative to the largest value: the weight gradient sums tokens' terms of both
        # signs, and a loss scale multiplies everything.
        rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2e-2, 1e-3)
        for what, a, b in zip(("per-token loss", "hidden gradient", "weight gradient"), ours, theirs):
            scale = max(1.0, float(b.detach().abs().max()))
            S.assert_close(self, a, b, rtol, atol * scale, what)


@S.requires_kernels
class TestPredictedStep(StepTestCase):
    """Megatron's default step: the prediction holds and the fused kernel runs."""

    def check(self, micro_batches: int, scale: Optional[float], per_token: bool,
              overwrite: bool) -> None:
        self.install(overwrite=overwrite)
        model, data = self.make_model(per_token, scale), self.inputs()
        spy = Spy()
        with mock.patch.object(_rescale, "rescale_fused_gradient", spy), \
                S.recorded_descriptors() as records:
            ours = self.step(model, data, micro_batches)
        names = [name for name, *_ in records]
        self.assertIn("grad_weights", names, "the fused kernel did not run")
        # One kernel on the logits, the fused one (a backward kernel would describe them
        # again; the rescale kernel describes the gradient, "grad").
        self.assertEqual(names.count("logits"), 1, f"a backward kernel ran: {names}")
        self.assertEqual(len(spy.calls), 1)
        weights, upstream = spy.calls[0]
        self.assertEqual(weights.dim(), 0, "a scalar prediction: no token is given weight 0")
        kept = data["mask"] > 0
        self.assertTrue(torch.equal(upstream[kept], weights.expand_as(upstream)[kept]),
                        f"prediction {weights} vs upstream {upstream[kept][:4]}")
        self.assertTrue(torch.equal(upstream[~kept], torch.zeros_like(upstream[~kept])))
        self.assert_same_step(ours, self.megatron_step(model, data, micro_batches))

    def test_default_step(self) -> None:
        self.check(micro_batches=1, scale=None, per_token=False, overwrite=False)

    def test_micro_batches_and_loss_scale(self) -> None:
        for micro_batches, scale in ((4, 1.0), (3, 4096.0), (8, 3.0)):
            with self.subTest(micro_batches=micro_batches, scale=scale):
                self.check(micro_batches, scale, per_token=False, overwrite=False)

    def test_per_token_loss(self) -> None:
        self.check(micro_batches=4, scale=1024.0, per_token=True, overwrite=False)

    def test_overwrite(self) -> None:
        self.check(micro_batches=2, scale=1.0, per_token=False, overwrite=True)

    def test_all_tokens_masked(self) -> None:
        model, data = self.make_model(), self.inputs()
        data["mask"] = torch.zeros_like(data["mask"])  # num_tokens 0, clamped to 1
        self.assert_same_step(self.step(model, data, 2), self.megatron_step(model, data, 2))

    def test_bf16(self) -> None:
        model, data = self.make_model(dtype=torch.bfloat16), self.inputs(torch.bfloat16)
        self.assert_same_step(self.step(model, data, 2), self.megatron_step(model, data, 2),
                              torch.bfloat16)


@S.requires_kernels
class TestMispredictedStep(StepTestCase):
    """Another reduction than the predicted one: the rescale makes the gradient right."""

    def test_weighted_loss_func(self) -> None:
        model, data = self.make_model(scale=2.0), self.inputs()
        weights = torch.rand((BATCH, SEQ), generator=S.generator(604)) * 3
        loss_func = functools.partial(weighted_loss_func, weights)
        self.assert_same_step(self.step(model, data, 3, loss_func),
                              self.megatron_step(model, data, 3, loss_func))

    def test_legacy_loss_func(self) -> None:
        model, data = self.make_model(), self.inputs()
        self.assert_same_step(self.step(model, data, 2, legacy_loss_func),
                              self.megatron_step(model, data, 2, legacy_loss_func))

    def test_micro_batch_count_changed_after_forward(self) -> None:
        model, data = self.make_model(), self.inputs()
        hidden = data["hidden"].clone().requires_grad_(True)
        num_microbatches_calculator.set_num_microbatches(2)  # the prediction's count
        output = model(hidden, data["labels"], loss_mask=data["mask"])
        loss, _ = schedules.forward_step_calc_loss(
            output, functools.partial(pretrain_loss_func, data["mask"]), model.config, 5)
        schedules.backward_step(loss, model.config)
        theirs = self.megatron_step(model, data, 5)
        self.assert_same_step((output.detach(), hidden.grad, model.output_weight.grad), theirs)


@S.requires_kernels
class TestWhenNotFused(StepTestCase):
    """The two-kernel path where no prediction is made."""

    def ran_fused(self, call: Callable[[], Any]) -> bool:
        with S.recorded_descriptors() as records:
            call()
        return "grad_weights" in [name for name, *_ in records]

    def test_setting_off(self) -> None:
        self.install(fused=False)
        model, data = self.make_model(), self.inputs()
        self.assertFalse(self.ran_fused(lambda: self.step(model, data, 1)))

    def test_not_the_main_loss(self) -> None:
        # Called from elsewhere than GPTModel._postprocess (e.g. multi-token prediction).
        model, data = self.make_model(), self.inputs()
        logits = torch.matmul(data["hidden"], model.output_weight.t())
        self.assertFalse(self.ran_fused(
            lambda: model.compute_language_model_loss(data["labels"], logits).sum().backward()))

    def test_no_grad(self) -> None:
        model, data = self.make_model(), self.inputs()
        with torch.no_grad():
            self.assertFalse(self.ran_fused(
                lambda: model(data["hidden"], data["labels"], loss_mask=data["mask"])))

    def test_settings(self) -> None:
        """On by default (issue 16 item 4: the fused kernel where the step's gradient is
        predictable), in the packaged YAML, on the command line and for a namespace made
        without add_turbo_ce_args; off by --no-turbo-ce-fused-gradient or an experiment
        YAML."""
        import argparse
        import tempfile
        from pathlib import Path

        self.assertTrue(turbo_ce.load_settings().turbo_ce_fused_gradient)
        self.assertTrue(turbo_ce.TurboCESettings().turbo_ce_fused_gradient)
        parser = turbo_ce.add_turbo_ce_args(argparse.ArgumentParser(), argv=[])
        self.assertTrue(parser.parse_args([]).turbo_ce_fused_gradient)
        self.assertTrue(parser.parse_args(["--turbo-ce-fused-gradient"]).turbo_ce_fused_gradient)
        self.assertFalse(
            parser.parse_args(["--no-turbo-ce-fused-gradient"]).turbo_ce_fused_gradient)
        bare = argparse.Namespace(use_turbo_cross_entropy=True)
        self.assertTrue(turbo_ce.settings_from_args(bare).turbo_ce_fused_gradient)
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "exp.yaml"
            path.write_text("turbo_cross_entropy:\n  turbo_ce_fused_gradient: false\n",
                            encoding="utf-8")
            self.assertFalse(turbo_ce.load_settings(path).turbo_ce_fused_gradient)
            parser = turbo_ce.add_turbo_ce_args(argparse.ArgumentParser(),
                                                 argv=["--turbo-ce-yaml", str(path)])
            self.assertFalse(parser.parse_args([]).turbo_ce_fused_gradient)

    def test_default_settings_run_the_fused_kernel(self) -> None:
        """--use-turbo-cross-entropy alone: Megatron's step runs the fused kernel."""
        import argparse

        parser = turbo_ce.add_turbo_ce_args(argparse.ArgumentParser(), argv=[])
        turbo_ce.install(parser.parse_args(["--use-turbo-cross-entropy"]))
        model, data = self.make_model(), self.inputs()
        self.assertTrue(self.ran_fused(lambda: self.step(model, data, 1)))


if __name__ == "__main__":
    unittest.main()
