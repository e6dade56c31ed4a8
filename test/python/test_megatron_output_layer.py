"""cegen.megatron's fused output layer (--turbo-ce-fuse-output-layer) on the stand-in's
GPTModel (test/python/megatron_standin), at TP = 1; the gloo TP = 2 group is in
test_tensor_parallel.py.

The fused post-processing (cegen.linear_cross_entropy in place of the output layer and the
loss) runs in float32 and is compared with the stand-in's unfused post-processing (its
ColumnParallelLinear, then Megatron's loss) in float64: the per-token loss and the gradients
of the hidden states, the output weight and its bias; tied embeddings; both loss
implementations on Megatron's SFT labels; a Megatron training step with
--turbo-ce-fused-gradient, where the forward's gradients must be the answer (no recompute, the
factor between the prediction and the upstream that arrives exactly 1), a loss_func with
per-token weights (reported, and right with the setting off) and a step without a loss mask
(nothing predicted); MuP's output multiplier (use_mup, mup_output_mult) applied in the kernels
as the logit scale, and through the loss patch alone, where _scale_logits has already scaled
the logits.
Every case it does not cover logs its reason once and runs GPTModel's post-processing
unchanged (bitwise the output without the flag).
"""

from __future__ import annotations

import argparse
import functools
import unittest
from typing import Any, Dict, List, Optional, Tuple
from unittest import mock

import _support as S
import torch

from cegen import _gradient_status, linear
from cegen import megatron as turbo_ce
from megatron.core import num_microbatches_calculator
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.common.language_module import language_module
from megatron.core.models.gpt import gpt_model
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel import schedules
from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, BATCH, HIDDEN, VOCAB = 7, 3, 16, 97
FUSE_LOG = "does not fuse the output layer"


def make_gpt(dtype: torch.dtype = torch.float32, *, tp: int = 1, impl: str = "native",
             fusion: bool = True, share: bool = False, bias: bool = False,
             parallel_output: bool = True, mtp_process: bool = False,
             **config: Any) -> GPTModel:
    """The stand-in GPTModel with the same random output weight (and bias) every time."""
    config = TransformerConfig(tensor_model_parallel_size=tp, cross_entropy_loss_fusion=fusion,
                               cross_entropy_fusion_impl=impl, **config)
    groups = ProcessGroupCollection(tp=FakeProcessGroup(tp), cp=FakeProcessGroup(1),
                                    pp=FakeProcessGroup(1), embd=None)
    weight = S.random_logits((VOCAB // tp, HIDDEN), torch.float64, scale=HIDDEN ** -0.5,
                             offset=700)
    model = GPTModel(config, HIDDEN, VOCAB, pg_collection=groups,
                     share_embeddings_and_output_weights=share, parallel_output=parallel_output,
                     mtp_process=mtp_process, bias=bias, dtype=dtype,
                     output_weight=weight.to(dtype))
    if bias:
        with torch.no_grad():
            model.output_layer.bias.copy_(S.random_logits((VOCAB // tp,), dtype, scale=0.5,
                                                          offset=701))
    return model


def output_weight(model: GPTModel) -> torch.Tensor:
    if model.share_embeddings_and_output_weights:
        return model.embedding.word_embeddings.weight
    return model.output_layer.weight


def inputs(labels: str = "plain", offset: int = 0) -> Dict[str, torch.Tensor]:
    """Hidden states (float64), labels [b, s] (plain, or Megatron's SFT ids), a loss mask
    and an upstream gradient."""
    label_values = (S.sft_labels((BATCH, SEQ), VOCAB, offset=710 + offset) if labels == "sft"
                    else S.random_labels((BATCH, SEQ), VOCAB, offset=710 + offset))
    mask = (torch.rand((BATCH, SEQ), generator=S.generator(711 + offset)) > 0.3).float()
    mask[0, 0] = 1.0
    return {"hidden": S.random_logits((SEQ, BATCH, HIDDEN), torch.float64, scale=1.0,
                                      offset=712 + offset),
            "labels": label_values, "mask": mask,
            "upstream": torch.rand((BATCH, SEQ), generator=S.generator(713 + offset)) + 0.25}


def install(fuse: bool = True, fused_gradient: bool = False) -> None:
    turbo_ce.install(turbo_ce.TurboCESettings(use_turbo_cross_entropy=True,
                                              turbo_ce_fused_gradient=fused_gradient,
                                              turbo_ce_fuse_output_layer=fuse))


def run(model: GPTModel, data: Dict[str, torch.Tensor], *, impl_zeroes_prompts: bool = False,
        **forward: Any) -> Tuple[Optional[torch.Tensor], ...]:
    """Loss [b, s], d hidden, d output weight, d bias of ``sum(loss * upstream)``."""
    dtype = output_weight(model).dtype
    hidden = data["hidden"].to(dtype).clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    loss = model(hidden, data["labels"], **forward)
    if impl_zeroes_prompts:  # TE's -100: loss 0, no gradient
        loss = torch.where(data["labels"] == -100, torch.zeros_like(loss), loss)
    (loss * data["upstream"].to(loss.dtype)).sum().backward()
    bias = model.output_layer.bias
    return (loss.detach(), hidden.grad, output_weight(model).grad,
            None if bias is None else bias.grad)


def reference(data: Dict[str, torch.Tensor], impl: str, **model: Any) -> Tuple[Optional[torch.Tensor], ...]:
    """The unfused post-processing in float64, without cegen: Megatron-Core's loss (the
    stand-in's native one; with ``te``, TE's loss 0 for -100, Core's for other ids outside
    the vocabulary, as cegen gives them)."""
    turbo_ce.uninstall()
    return run(make_gpt(torch.float64, impl="native", **model), data,
               impl_zeroes_prompts=impl == "te")


class OutputLayerTestCase(unittest.TestCase):
    def setUp(self) -> None:
        turbo_ce.reset_fallback_log()
        self.addCleanup(turbo_ce.uninstall)
        self.addCleanup(num_microbatches_calculator.set_num_microbatches, 1)
        for calls in (gpt_model.CALLS, language_module.CALLS):
            for key in calls:
                calls[key] = 0

    def assert_close_all(self, ours: Tuple[Optional[torch.Tensor], ...],
                         theirs: Tuple[Optional[torch.Tensor], ...], what: str) -> None:
        names = ("per-token loss", "d hidden", "d output weight", "d bias")
        for name, a, b in zip(names, ours, theirs):
            if b is None:
                self.assertIsNone(a, f"{what}: {name}")
                continue
            self.assertIsNotNone(a, f"{what}: no {name}")
            scale = max(1.0, float(b.abs().max()))
            S.assert_close(self, a, b, 1e-5, 1e-6 * scale, f"{what}: {name}")


@S.requires_kernels
class TestFusedOutputLayer(OutputLayerTestCase):
    """The covered cases: the output layer and the loss computed together."""

    def test_matches_unfused_float64(self) -> None:
        index = 0
        for impl in ("native", "te"):
            for share in (False, True):
                for bias in (False, True):
                    for labels in ("plain", "sft"):
                        index += 1
                        with self.subTest(impl=impl, share=share, bias=bias, labels=labels):
                            data = inputs(labels, offset=10 * index)
                            install()
                            before = (gpt_model.CALLS["output_layer"],
                                      language_module.CALLS["compute_language_model_loss"])
                            with self.assertNoLogs("cegen.megatron", level="WARNING"):
                                ours = run(make_gpt(impl=impl, share=share, bias=bias), data)
                            self.assertEqual((gpt_model.CALLS["output_layer"],
                                              language_module.CALLS["compute_language_model_loss"]),
                                             before, "the output layer or the loss ran")
                            self.assertEqual((ours[0].dtype, tuple(ours[0].shape)),
                                             (torch.float32, (BATCH, SEQ)))
                            theirs = reference(data, impl, share=share, bias=bias)
                            self.assert_close_all(ours, theirs, f"{impl} share={share} bias={bias}")

    def test_eval_without_gradients(self) -> None:
        data = inputs()
        install()
        model = make_gpt()
        with torch.no_grad():
            loss = model(data["hidden"].float(), data["labels"])
        self.assertEqual(gpt_model.CALLS["output_layer"], 0)
        theirs = reference(data, "native")
        S.assert_close(self, loss, theirs[0], 1e-5, 1e-5, "loss")

    def test_not_the_last_stage(self) -> None:
        install()
        model = make_gpt()
        model.post_process = False
        hidden = inputs()["hidden"].float()
        with self.assertNoLogs("cegen.megatron", level="WARNING"):
            self.assertIs(model(hidden, inputs()["labels"]), hidden)


def pretrain_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):  # type: ignore[no-untyped-def]
    """pretrain_gpt.py's loss_func (the default branch)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": loss.detach()}


def weighted_loss_func(weights: torch.Tensor, loss_mask: torch.Tensor, output_tensor: torch.Tensor):  # type: ignore[no-untyped-def]
    """A user's loss_func with per-token weights: not what the prediction assumes."""
    return pretrain_loss_func(loss_mask * weights, output_tensor)


@S.requires_kernels
class TestFusedGradientStep(OutputLayerTestCase):
    """With --turbo-ce-fused-gradient too: Megatron's training step (loss_func, the
    schedule's divisions, the loss scale) gives each token the upstream gradient predicted
    in the forward (loss_mask times the factor), so the forward's gradients are used as they
    are (three GEMMs, no recompute, the factor the backward finds on the device exactly 1);
    a loss_func with per-token weights is reported (UnpredictedUpstreamError naming
    --no-turbo-ce-fused-gradient) and is right with the setting off."""

    def step(self, model: GPTModel, data: Dict[str, torch.Tensor], micro_batches: int,
             loss_func: Any = pretrain_loss_func,
             with_mask: bool = True) -> Tuple[Optional[torch.Tensor], ...]:
        hidden = data["hidden"].to(output_weight(model).dtype).clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        num_microbatches_calculator.set_num_microbatches(micro_batches)
        output = model(hidden, data["labels"],
                       **({"loss_mask": data["mask"]} if with_mask else {}))
        loss, _ = schedules.forward_step_calc_loss(
            output, functools.partial(loss_func, data["mask"]), model.config, micro_batches)
        schedules.backward_step(loss, model.config)
        return output.detach(), hidden.grad, output_weight(model).grad, None

    def check(self, micro_batches: int, scale: Optional[float], per_token: bool,
              loss_func: Any, recomputes: List[str], fused_gradient: bool = True,
              factors: Optional[List[float]] = None, with_mask: bool = True,
              **model: Any) -> None:
        """Our step (recomputes: linear's, "all" or "d weight"; factors: the ones the
        backward found) against the float64 step without cegen; ``model``: more of the
        model's config."""
        scale_tensor = None if scale is None else torch.tensor([scale])
        config = dict(calculate_per_token_loss=per_token,
                      grad_scale_func=None if scale is None else (lambda loss: scale_tensor * loss),
                      **model)
        data = inputs(offset=micro_batches)
        install(fused_gradient=fused_gradient)
        calls: List[str] = []
        found: List[torch.Tensor] = []
        real, real_factor = linear._recompute_grads, linear._common_factor

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append("all" if kwargs.get("grad_hidden") is None else "d weight")
            return real(*args, **kwargs)

        def factor(*args: Any) -> Any:
            result = real_factor(*args)
            found.append(result[0].clone())
            return result

        before = gpt_model.CALLS["output_layer"]
        with mock.patch.object(linear, "_recompute_grads", counted), \
                mock.patch.object(linear, "_common_factor", factor):
            ours = self.step(make_gpt(**config), data, micro_batches, loss_func, with_mask)
        self.assertEqual(gpt_model.CALLS["output_layer"], before, "the output layer ran")
        self.assertEqual(calls, recomputes, "backward recomputes")
        if factors is not None:
            self.assertEqual([float(f) for f in found], factors, "the backward's factor")
        turbo_ce.uninstall()
        theirs = self.step(make_gpt(torch.float64, **config), data, micro_batches, loss_func,
                           with_mask)
        self.assert_close_all(ours, theirs, f"micro-batches {micro_batches} scale {scale}")

    def test_predicted_upstream_is_the_one_that_arrives(self) -> None:
        # Megatron's upstream is losses * loss_mask's backward, a new tensor: the backward
        # finds the factor between it and the prediction on the device, exactly 1 (the
        # prediction bitwise the upstream on every unmasked token, 0 on the masked ones).
        for micro_batches, scale, per_token in ((1, None, False), (3, 1024.0, False),
                                                (2, 4096.0, True)):
            with self.subTest(micro_batches=micro_batches, scale=scale, per_token=per_token):
                self.check(micro_batches, scale, per_token, pretrain_loss_func, recomputes=[],
                           factors=[1.0])

    def test_mup(self) -> None:
        """MuP's output multiplier as the logit scale (TestMuP): the forward's gradients are
        of the scaled logits and used as they are (the backward's factor exactly 1)."""
        self.check(2, 1024.0, False, pretrain_loss_func, recomputes=[], factors=[1.0],
                   use_mup=True, mup_output_mult=0.25)

    def test_micro_batch_count_changed_after_forward(self) -> None:
        """The prediction off by a factor (the micro-batch count changed between forward
        and backward): the backward scales d weight by it, no recompute, right."""
        data = inputs(offset=30)
        install(fused_gradient=True)
        model = make_gpt()
        hidden = data["hidden"].float().clone().requires_grad_(True)
        num_microbatches_calculator.set_num_microbatches(2)  # the prediction's count
        calls: List[int] = []
        real = linear._recompute_grads
        with mock.patch.object(linear, "_recompute_grads",
                               lambda *a, **k: calls.append(1) or real(*a, **k)):
            output = model(hidden, data["labels"], loss_mask=data["mask"])
            loss, _ = schedules.forward_step_calc_loss(
                output, functools.partial(pretrain_loss_func, data["mask"]), model.config, 5)
            schedules.backward_step(loss, model.config)
        self.assertEqual(calls, [], "backward recomputes")
        ours = (output.detach(), hidden.grad, output_weight(model).grad, None)
        turbo_ce.uninstall()
        theirs = self.step(make_gpt(torch.float64), data, 5)
        self.assert_close_all(ours, theirs, "micro-batches 2 predicted, 5 in the backward")

    def test_per_token_weights_are_reported(self) -> None:
        """A loss_func with per-token weights: not loss_mask times one factor. The backward
        (on the CPU) raises UnpredictedUpstreamError, which names the switch; with the
        switch off the step is right (the recompute schedule, four GEMMs)."""
        weights = torch.rand((BATCH, SEQ), generator=S.generator(720)) + 0.5
        loss_func = functools.partial(weighted_loss_func, weights)
        with self.assertRaisesRegex(_gradient_status.UnpredictedUpstreamError,
                                    "--no-turbo-ce-fused-gradient"):
            self.check(2, 8.0, False, loss_func, recomputes=[])
        turbo_ce.uninstall()
        self.check(2, 8.0, False, loss_func, recomputes=["all"], fused_gradient=False)

    def test_no_loss_mask_predicts_nothing(self) -> None:
        """Without a loss mask in GPTModel's call nothing is predicted: the schedule that
        recomputes the logits, right for the step's upstream."""
        self.check(2, 2.0, False, pretrain_loss_func, recomputes=["all"], factors=[],
                   with_mask=False)


@S.requires_kernels
class TestMuP(OutputLayerTestCase):
    """MuP (use_mup): GPTModel._postprocess multiplies the output layer's logits by
    mup_output_mult (_scale_logits) before the loss. The fused output layer applies it in the
    kernels as the logit scale; the loss patch alone receives the scaled logits and applies
    nothing more. Both against the float64 post-processing without cegen (its own
    _scale_logits), and the scale must matter: the unscaled loss is far from it."""

    def check_mup(self, fuse: bool, multiplier: float, offset: int, *, overwrite: bool = False,
                  **model: Any) -> None:
        data = inputs("sft" if model.get("impl") == "te" else "plain", offset=offset)
        turbo_ce.install(turbo_ce.TurboCESettings(use_turbo_cross_entropy=True,
                                                  turbo_ce_fused_gradient=False,
                                                  turbo_ce_overwrite_input=overwrite,
                                                  turbo_ce_fuse_output_layer=fuse))
        before = (gpt_model.CALLS["output_layer"],
                  language_module.CALLS["compute_language_model_loss"])
        with self.assertNoLogs("cegen.megatron", level="WARNING"):
            ours = run(make_gpt(use_mup=True, mup_output_mult=multiplier, **model), data)
        # Megatron's loss never runs (cegen's does); its output layer only without fusing.
        self.assertEqual((gpt_model.CALLS["output_layer"],
                          language_module.CALLS["compute_language_model_loss"]),
                         (before[0] + (0 if fuse else 1), before[1]),
                         "the output layer's and Megatron's loss's runs")
        impl = model.pop("impl", "native")
        theirs = reference(data, impl, use_mup=True, mup_output_mult=multiplier, **model)
        self.assert_close_all(ours, theirs, f"fuse={fuse} mup_output_mult={multiplier} {model}")
        unscaled = reference(data, impl, **model)[0]
        self.assertGreater(float((unscaled - theirs[0]).abs().max()), 1e-2,
                           "the multiplier does not change the loss: nothing is tested")

    def test_fused_output_layer(self) -> None:
        cases = [(0.25, dict()), (1 / 3, dict(share=True)), (0.125, dict(bias=True, impl="te")),
                 (6.0, dict(bias=True))]
        for index, (multiplier, model) in enumerate(cases):
            with self.subTest(multiplier=multiplier, **model):
                self.check_mup(True, multiplier, 40 + 10 * index, **model)

    def test_loss_patch_alone(self) -> None:
        for index, (multiplier, overwrite) in enumerate(((0.25, False), (1 / 3, True))):
            with self.subTest(multiplier=multiplier, overwrite=overwrite):
                self.check_mup(False, multiplier, 90 + 10 * index, overwrite=overwrite)

    def test_the_scale_megatron_applies(self) -> None:
        """use_mup off, or a multiplier of 1: no scale; otherwise the multiplier, rounded
        to float32."""
        for config, scale in ((dict(mup_output_mult=0.25), 1.0),
                              (dict(use_mup=True), 1.0),
                              (dict(use_mup=True, mup_output_mult=0.25), 0.25),
                              (dict(use_mup=True, mup_output_mult=1 / 3),
                               float(torch.tensor(1 / 3, dtype=torch.float32)))):
            with self.subTest(**config):
                self.assertEqual(turbo_ce._mup_logit_scale(make_gpt(**config)), (None, scale))
        for multiplier in (float("inf"), float("nan"), 1e39, 1e-50, -0.5, 0.0, "0.5", True):
            with self.subTest(multiplier=multiplier):
                reason, scale = turbo_ce._mup_logit_scale(
                    make_gpt(use_mup=True, mup_output_mult=multiplier))
                self.assertRegex(reason or "", "is not a logit scale cegen can apply")
                self.assertEqual(scale, 1.0)


class TestFallback(OutputLayerTestCase):
    """Every case the fused output layer does not cover: the reason logged once, and
    GPTModel's post-processing unchanged (its output bitwise the one without the flag)."""

    def assert_falls_back(self, make: Any, reason: str, *, labels: bool = True,
                          dtype: torch.dtype = torch.float32, output_layer_runs: int = 1,
                          **forward: Any) -> None:
        data = inputs()
        hidden = data["hidden"].to(dtype)
        target = data["labels"] if labels else None
        install(fuse=False)  # the loss patch alone: what the fallback runs
        expected = make()(hidden, target, **forward)
        install()
        turbo_ce.reset_fallback_log()
        model = make()
        calls = gpt_model.CALLS["output_layer"]
        with self.assertLogs("cegen.megatron", level="WARNING") as logs:
            output = model(hidden, target, **forward)
        fused_logs = [line for line in logs.output if FUSE_LOG in line]
        self.assertEqual(len(fused_logs), 1, logs.output)
        self.assertRegex(fused_logs[0], reason)
        self.assertEqual(gpt_model.CALLS["output_layer"], calls + output_layer_runs,
                         "the output layer's runs")
        self.assertTrue(torch.equal(output, expected))
        with self.assertNoLogs("cegen.megatron", level="WARNING"):
            model(hidden, target, **forward)  # each reason is logged once

    def test_no_labels_returns_the_logits(self) -> None:
        self.assert_falls_back(make_gpt, "no labels: the caller gets the logits", labels=False)

    def test_inference(self) -> None:
        with InferenceMode.active():
            self.assert_falls_back(make_gpt, "inference", runtime_gather_output=True)
        self.assert_falls_back(make_gpt, "inference", inference_context=object())

    def test_multi_token_prediction(self) -> None:
        self.assert_falls_back(functools.partial(make_gpt, mtp_process=True),
                               r"multi-token prediction \(MTP layers\)")
        self.assert_falls_back(functools.partial(make_gpt, mtp_num_layers=1),
                               "multi-token prediction")

    def test_output_processor(self) -> None:
        def processor(hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return hidden_states * 2

        self.assert_falls_back(make_gpt, "an output_processor", output_processor=processor,
                               output_layer_runs=0)  # the processor has it

    def test_gathered_logits(self) -> None:
        self.assert_falls_back(make_gpt, "the logits are gathered", runtime_gather_output=True)
        self.assert_falls_back(functools.partial(make_gpt, parallel_output=False),
                               "the logits are gathered")

    def test_config_cases(self) -> None:
        cases = [
            (dict(use_mup=True, mup_output_mult=-0.5), r"mup_output_mult=-0.5 is not a logit scale"),
            (dict(use_mup=True, mup_output_mult=0.0), r"mup_output_mult=0.0 is not a logit scale"),
            (dict(config_logger_dir="/nonexistent"), "the config logger records the logits"),
            (dict(defer_embedding_wgrad_compute=True), "defer_embedding_wgrad_compute"),
            (dict(cuda_graph_impl="full_iteration"), "full-iteration CUDA graphs"),
            (dict(fusion=False), "cross_entropy_loss_fusion is off"),
            (dict(tp=2), "tensor-parallel size is 2 but torch.distributed is not initialized"),
        ]
        for config, reason in cases:
            with self.subTest(config=config):
                self.assert_falls_back(functools.partial(make_gpt, **config), reason)

    def test_unsupported_dtypes(self) -> None:
        self.assert_falls_back(functools.partial(make_gpt, torch.float64),
                               "hidden states of dtype torch.float64 are not supported",
                               dtype=torch.float64)

        def mixed() -> GPTModel:  # a bf16 output layer with an fp32 bias: fp32 logits
            model = make_gpt(torch.bfloat16, bias=True)
            model.output_layer.bias.data = model.output_layer.bias.data.float()
            return model

        self.assert_falls_back(mixed, r"\(torch.bfloat16\) and the output layer's weight "
                                      r"\(torch.bfloat16\) and bias \(torch.float32\) differ",
                               dtype=torch.bfloat16)

        def logit_dtype() -> GPTModel:
            model = make_gpt()
            model.output_layer.output_dtype = torch.float64
            return model

        self.assert_falls_back(logit_dtype, r"makes torch.float64 logits from torch.float32")

    def test_another_loss(self) -> None:
        class OwnLoss(GPTModel):
            def compute_language_model_loss(self, labels, logits):  # type: ignore[no-untyped-def]
                return super().compute_language_model_loss(labels, logits) * 2

        config = TransformerConfig(cross_entropy_loss_fusion=True)
        groups = ProcessGroupCollection(tp=FakeProcessGroup(1), cp=FakeProcessGroup(1),
                                        pp=FakeProcessGroup(1), embd=None)
        weight = make_gpt().output_layer.weight.detach()
        self.assert_falls_back(lambda: OwnLoss(config, HIDDEN, VOCAB, pg_collection=groups,
                                               output_weight=weight.clone()),
                               "compute_language_model_loss is not cegen's")

    def test_own_logit_scaling(self) -> None:
        """A _scale_logits that is not Megatron-Core's (a subclass's, an instance's): its
        transform is not known, GPTModel's post-processing runs it."""
        class SoftcappedLogits(GPTModel):
            def _scale_logits(self, logits):  # type: ignore[no-untyped-def]
                return 30.0 * torch.tanh(super()._scale_logits(logits) / 30.0)

        config = TransformerConfig(cross_entropy_loss_fusion=True, use_mup=True,
                                   mup_output_mult=0.5)
        groups = ProcessGroupCollection(tp=FakeProcessGroup(1), cp=FakeProcessGroup(1),
                                        pp=FakeProcessGroup(1), embd=None)
        weight = make_gpt().output_layer.weight.detach()
        self.assert_falls_back(lambda: SoftcappedLogits(config, HIDDEN, VOCAB, pg_collection=groups,
                                                        output_weight=weight.clone()),
                               r"_scale_logits is defined by .*SoftcappedLogits, not")

        def instance() -> GPTModel:
            model = make_gpt(use_mup=True, mup_output_mult=0.5)
            model._scale_logits = lambda logits: logits * 0.5  # type: ignore[method-assign]
            return model

        self.assert_falls_back(instance, "_scale_logits is defined by the instance")

    def test_bridge_softcapped_output_layer(self) -> None:
        """Megatron-Bridge's Gemma2/Gemma4 output layer: its class, made by extend_instance,
        takes ColumnParallelLinear's name over (Gemma2OutputLayer, ColumnParallelLinear); its
        forward softcaps the logits. Not fused: the loss patch gets the capped logits."""
        class Gemma2OutputLayer(torch.nn.Module):
            def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                output, bias = super().forward(*args, **kwargs)
                return 30.0 * torch.tanh(output / 30.0), bias

        def make() -> GPTModel:
            model = make_gpt()
            layer = model.output_layer  # megatron.bridge.models.gemma.modules.extend_instance
            layer.__class__ = type(type(layer).__name__, (Gemma2OutputLayer, type(layer)), {})
            return model

        self.assert_falls_back(make, "the output layer is a ColumnParallelLinear with "
                                     "Gemma2OutputLayer mixed in, not Megatron-Core's")

    def test_another_output_layer(self) -> None:
        class OwnLayer(ColumnParallelLinear):
            pass

        def make() -> GPTModel:
            model = make_gpt()
            model.output_layer.__class__ = OwnLayer
            return model

        self.assert_falls_back(make, "the output layer is a OwnLayer, not Megatron-Core's")


class TestInstall(unittest.TestCase):
    def tearDown(self) -> None:
        turbo_ce.uninstall()

    def test_patched_only_with_the_flag(self) -> None:
        original = GPTModel.__dict__["_postprocess"]
        install(fuse=False)
        self.assertIs(GPTModel.__dict__["_postprocess"], original)
        install()
        self.assertIsNot(GPTModel.__dict__["_postprocess"], original)
        self.assertIs(GPTModel.__dict__["_postprocess"]._cegen_original, original)
        install()  # idempotent: one layer
        self.assertIs(GPTModel.__dict__["_postprocess"]._cegen_original, original)
        turbo_ce.uninstall()
        self.assertIs(GPTModel.__dict__["_postprocess"], original)
        install()
        turbo_ce.install(turbo_ce.TurboCESettings())  # off: everything restored
        self.assertIs(GPTModel.__dict__["_postprocess"], original)

    def test_argument(self) -> None:
        parser = turbo_ce.add_turbo_ce_args(argparse.ArgumentParser(), argv=[])
        self.assertFalse(parser.parse_args([]).turbo_ce_fuse_output_layer)
        # with it, the fused gradient is on by default (three GEMMs in Megatron's step)
        self.assertTrue(parser.parse_args([]).turbo_ce_fused_gradient)
        self.assertFalse(turbo_ce.load_settings().turbo_ce_fuse_output_layer)
        args = parser.parse_args(["--use-turbo-cross-entropy", "--turbo-ce-fuse-output-layer"])
        self.assertTrue(turbo_ce.settings_from_args(args).turbo_ce_fuse_output_layer)


if __name__ == "__main__":
    unittest.main()
