#!/usr/bin/env python3
"""cegen.megatron against real Megatron-Core source, on a CUDA GPU.

Not a CI test: CI tests the patch against the stand-in in test/python/megatron_standin. This
one needs a CUDA GPU, Megatron-Core's source (never committed: export ``megatron/core`` of a
Megatron-LM checkout into ``.dev/megatron``), an sm_90 bundle and the runtime library:

    git --git-dir=<Megatron-LM.git> archive HEAD megatron/core | tar -x -C .dev/megatron
    build/bin/ce-gen --target=sm_90 --op=forward,backward,fused,rescale --logits=bf16,f32 \\
        --labels=i64 --layout=flat,sbv_bs --overwrite=0,1 --weights=token \\
        -o .dev/megatron-bundle    # flat, fused and rescale: the fused output layer's chunks
    test/gpu/prepare_device_run.sh   # or any libce_runtime.so built for the GPU machine
    PYTHONPATH=.dev/megatron:python python3 test/gpu/test_megatron_real.py

The bundle must come from a ce-gen with the run-time label policy (bundle format 2, issue 22):
the SFT case runs the same variants with ``label_out_of_range="megatron"``.

The paths default to those above and may be changed with CEGEN_MEGATRON_SRC,
CEGEN_TEST_RUNTIME and CEGEN_TEST_BUNDLE (test paths only; the package reads no environment
variable). Without CUDA or without the Megatron source every test is skipped with the reason.

A single-rank NCCL process group, ``initialize_model_parallel(1, 1)`` and a small real
``GPTModel`` (2 layers, hidden 256, 4 heads, bf16 parameters, local non-TE layer spec,
``cross_entropy_loss_fusion=True``, wrapped in Float16Module as Megatron does for bf16), vocab 32000, seq 256, micro-batch 4. Checks:

1. ``compute_language_model_loss`` called directly on the same [s, b, v] logits and [b, s]
   labels, original vs patched (``--use-turbo-cross-entropy`` parsed by a real argparse
   parser through ``add_turbo_ce_args``), overwrite-input off and on: per-token loss within
   1e-3, gradient w.r.t. the logits (read through a non-contiguous upstream gradient) within
   bf16 rounding; with overwrite-input the logits' storage holds the gradient afterwards.
2. The whole GPTModel forward/backward with labels, original vs patched, overwrite-input off
   and on: loss [b, s] within 1e-3, gradients of every parameter within a small relative
   error; with overwrite-input the gradient arriving at the output layer lives in the logits'
   own storage (Megatron's caller qualifies) and no OverwriteRefusedWarning is raised.
3. Fallback: with ``cross_entropy_loss_fusion=False`` the patched method calls Megatron's
   ``vocab_parallel_cross_entropy`` (the original's loss) and logs the reason once over two
   calls; ``--no-use-turbo-cross-entropy`` patches nothing.
4. 20 AdamW steps of the GPTModel on a synthetic bigram task with the patch (overwrite-input
   on) and with Megatron's loss, from the same weights and batches: all losses finite, the
   patched loss falls, and the two curves agree within bf16 noise.
5. SFT (issue 22): batches whose prompt tokens are labelled -100 and zeroed in ``loss_mask``,
   as Megatron's SFT dataset makes them. The patched loss does not raise; its per-token loss
   (the -100 tokens included: Megatron-Core gives them ``lse - max``) equals Megatron's own
   within 1e-3, also with a label outside the vocabulary of each other kind (-1, V, 2**40);
   and 10 AdamW steps on the masked mean, patched (overwrite-input on) and unpatched, stay
   finite and agree within bf16 noise.
6. The fused output layer (issue 18, ``--turbo-ce-fuse-output-layer``): GPTModel's
   post-processing runs ``cegen.linear_cross_entropy`` (the output layer's forward, so the
   full logits, never happen; no fallback logged); loss within 1e-3 and every parameter's
   gradient within PARAM_GRAD_TOL of Megatron's own loss and of the unfused patch; 20 AdamW
   steps finite, falling, and within bf16 noise of Megatron's curve.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys
import unittest
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
MEGATRON_SRC = Path(os.environ.get("CEGEN_MEGATRON_SRC", REPO / ".dev" / "megatron"))
RUNTIME = Path(os.environ.get("CEGEN_TEST_RUNTIME", REPO / ".dev" / "train" / "libce_runtime.so"))
BUNDLE = Path(os.environ.get("CEGEN_TEST_BUNDLE", REPO / ".dev" / "megatron-bundle"))

VOCAB, SEQ, BATCH = 32000, 256, 4
LOSS_TOL = 1e-3          # per-token loss, absolute
LOGITS_GRAD_TOL = 1e-2   # ||g_cegen - g_megatron|| / ||g_megatron|| for d loss / d logits
PARAM_GRAD_TOL = 2e-2    # the same, per parameter, worst parameter
TRAIN_STEPS = 20
SFT_STEPS = 10

try:
    import torch
except ImportError:  # pragma: no cover - the GPU machine has it
    torch = None  # type: ignore[assignment]


def _skip_reason() -> Optional[str]:
    if torch is None:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not (MEGATRON_SRC / "megatron" / "core" / "__init__.py").is_file():
        return (f"no Megatron-Core source at {MEGATRON_SRC} (export megatron/core of a "
                "Megatron-LM checkout there; see this file's docstring)")
    if not RUNTIME.is_file():
        return f"no runtime library at {RUNTIME} (run test/gpu/prepare_device_run.sh)"
    if not (BUNDLE / "manifest.json").is_file():
        return f"no sm_90 bundle at {BUNDLE} (see this file's docstring)"
    return None


SKIP_REASON = _skip_reason()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rel_err(got: "torch.Tensor", want: "torch.Tensor") -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@unittest.skipIf(SKIP_REASON is not None, f"SKIP: {SKIP_REASON}")
class TestRealMegatronCore(unittest.TestCase):
    """cegen's patch of LanguageModule.compute_language_model_loss in real Megatron-Core."""

    @classmethod
    def setUpClass(cls) -> None:
        for path in (str(REPO / "python"), str(MEGATRON_SRC)):
            if path not in sys.path:
                sys.path.insert(0, path)
        import torch.distributed as dist

        import cegen
        from cegen import megatron as turbo_ce
        from megatron.core import parallel_state
        from megatron.core.models.common.language_module.language_module import LanguageModule
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig

        cls.cegen, cls.turbo_ce, cls.LanguageModule = cegen, turbo_ce, LanguageModule
        cls.parallel_state = parallel_state
        cegen.set_runtime_library(RUNTIME)
        cegen.configure(bundle_dirs=[BUNDLE])
        turbo_ce.uninstall()

        torch.cuda.set_device(0)
        cls.own_group = not dist.is_initialized()
        if cls.own_group:
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    world_size=1, rank=0)
        # No Gloo groups: nothing here uses them, and Gloo needs a resolvable host name.
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
        model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)

        cls.config = TransformerConfig(
            num_layers=2, hidden_size=256, num_attention_heads=4,
            bf16=True, params_dtype=torch.bfloat16,
            hidden_dropout=0.0, attention_dropout=0.0,
            cross_entropy_loss_fusion=True,
        )
        cls.gpt = GPTModel(config=cls.config, transformer_layer_spec=get_gpt_layer_local_spec(),
                           vocab_size=VOCAB, max_sequence_length=SEQ).cuda()
        # As Megatron's get_model does for --bf16: the wrapper casts the whole model (the
        # position embeddings and norms too) to bf16; the loss it returns stays fp32.
        cls.model = Float16Module(cls.config, cls.gpt)
        cls.initial = {n: p.detach().clone() for n, p in cls.model.named_parameters()}

        # Synthetic bigram data: next token = perm[token] with probability 0.75.
        gen = torch.Generator(device="cuda").manual_seed(4321)
        cls.perm = torch.randperm(VOCAB, generator=gen, device="cuda")
        cls.gen = gen
        cls.input_ids, cls.labels = cls.batch()
        cls.position_ids = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, SEQ)
        cls.loss_mask = torch.ones(BATCH, SEQ, device="cuda")
        print(f"\n[setup] torch {torch.__version__}, {torch.cuda.get_device_name()}, Megatron-Core "
              f"{cls.megatron_version()} from {MEGATRON_SRC}; GPTModel "
              f"{sum(p.numel() for p in cls.model.parameters())} parameters, "
              f"attention {cls.core_attention_name()}, "
              f"V={VOCAB} S={SEQ} B={BATCH}", flush=True)

    @classmethod
    def tearDownClass(cls) -> None:
        import torch.distributed as dist

        cls.turbo_ce.uninstall()
        cls.parallel_state.destroy_model_parallel()
        if cls.own_group and dist.is_initialized():
            dist.destroy_process_group()

    @classmethod
    def core_attention_name(cls) -> str:
        names = sorted({type(m).__name__ for m in cls.model.modules()
                        if type(m).__name__.endswith("DotProductAttention")})
        return ", ".join(names) or "?"

    @staticmethod
    def megatron_version() -> str:
        try:
            from megatron.core import package_info

            return str(package_info.__version__)
        except Exception:  # pragma: no cover
            return "?"

    @classmethod
    def batch(cls) -> Tuple["torch.Tensor", "torch.Tensor"]:
        tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long, device="cuda")
        tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=cls.gen, device="cuda")
        follow = torch.rand(BATCH, SEQ, generator=cls.gen, device="cuda") < 0.75
        uniform = torch.randint(0, VOCAB, (BATCH, SEQ), generator=cls.gen, device="cuda")
        for t in range(SEQ):
            tokens[:, t + 1] = torch.where(follow[:, t], cls.perm[tokens[:, t]], uniform[:, t])
        # Megatron's get_batch hands the model contiguous [b, s] tokens and labels.
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    # -- helpers ---------------------------------------------------------------------------

    def parse(self, argv: List[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
        parser.add_argument("--cross-entropy-loss-fusion", action="store_true")
        return self.turbo_ce.add_turbo_ce_args(parser, argv=argv).parse_args(argv)

    def install(self, overwrite: bool, fuse_output_layer: bool = False) -> None:
        argv = ["--cross-entropy-loss-fusion", "--use-turbo-cross-entropy"]
        argv += ["--turbo-ce-overwrite-input"] if overwrite else []
        argv += ["--turbo-ce-fuse-output-layer"] if fuse_output_layer else []
        args = self.parse(argv)
        self.assertTrue(args.use_turbo_cross_entropy)
        self.assertEqual(args.turbo_ce_overwrite_input, overwrite)
        self.assertEqual(args.turbo_ce_fuse_output_layer, fuse_output_layer)
        self.assertTrue(self.turbo_ce.install(args))
        self.assertTrue(self.turbo_ce.is_installed())

    def restore_weights(self) -> None:
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(self.initial[name])

    def model_loss_and_grads(self) -> Tuple["torch.Tensor", Dict[str, "torch.Tensor"], dict]:
        """One forward/backward of the GPTModel with labels; the loss, grads and pointers."""
        model = self.model
        model.zero_grad(set_to_none=True)
        seen: dict = {}

        def record_grad(grad: "torch.Tensor") -> None:
            seen["grad_ptr"] = grad.data_ptr()

        def forward_hook(module, inputs, output):  # type: ignore[no-untyped-def]
            logits = output[0]  # no reference kept: only its address and a gradient hook
            seen["logits_ptr"] = logits.data_ptr()
            seen["logits_dtype"] = logits.dtype
            seen["logits_shape"] = tuple(logits.shape)
            logits.register_hook(record_grad)

        handle = self.gpt.output_layer.register_forward_hook(forward_hook)
        try:
            self.cegen.reset_overwrite_warnings()  # a reason warns once per process
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = model(self.input_ids, self.position_ids, None, labels=self.labels)
                total = (loss * self.loss_mask).sum() / self.loss_mask.sum()
                total.backward()
        finally:
            handle.remove()
        torch.cuda.synchronize()
        self.cegen.check_labels()
        seen["refused"] = [str(w.message) for w in caught
                           if issubclass(w.category, self.cegen.OverwriteRefusedWarning)]
        seen["loss_shape"], seen["loss_dtype"] = tuple(loss.shape), loss.dtype
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        return loss.detach().clone(), grads, seen

    # -- 1. the method itself on the same logits and labels ------------------------------

    def test_1_direct_call_same_logits(self) -> None:
        self.turbo_ce.uninstall()
        self.restore_weights()
        with torch.no_grad():  # the model's own [s, b, v] bf16 logits for the batch
            logits_bsv = self.gpt(self.input_ids, self.position_ids, None)  # bf16, unwrapped
        logits = logits_bsv.transpose(0, 1).contiguous()
        del logits_bsv
        self.assertEqual(logits.dtype, torch.bfloat16)
        self.assertEqual(tuple(logits.shape), (SEQ, BATCH, VOCAB))
        upstream = torch.rand(SEQ, BATCH, device="cuda").t()  # a non-contiguous [b, s] view
        original = self.LanguageModule.compute_language_model_loss

        def run(method) -> Tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:  # type: ignore[no-untyped-def]
            leaf = logits.clone().requires_grad_(True)
            y = leaf.clone()  # a non-leaf held by one local variable, as in GPTModel._postprocess
            loss = method(self.gpt, self.labels, y)
            (loss * upstream).sum().backward()
            torch.cuda.synchronize()
            return loss.detach(), leaf.grad.detach(), y.detach()

        want_loss, want_grad, _ = run(original)
        for overwrite in (False, True):
            with self.subTest(overwrite_input=overwrite):
                self.install(overwrite)
                try:
                    patched = self.LanguageModule.compute_language_model_loss
                    self.assertIsNot(patched, original)
                    self.cegen.reset_overwrite_warnings()
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        got_loss, got_grad, y_after = run(patched)
                    self.cegen.check_labels()
                finally:
                    self.turbo_ce.uninstall()
                refused = [str(w.message) for w in caught
                           if issubclass(w.category, self.cegen.OverwriteRefusedWarning)]
                loss_diff = float((got_loss - want_loss).abs().max())
                grad_rel = _rel_err(got_grad.float(), want_grad.float())
                grad_abs = float((got_grad.float() - want_grad.float()).abs().max())
                holds_grad = bool(torch.equal(y_after, got_grad))
                print(f"[direct overwrite={overwrite}] loss {tuple(got_loss.shape)} "
                      f"{got_loss.dtype} max|dloss| {loss_diff:.3e}; d/dlogits rel err "
                      f"{grad_rel:.3e}, max abs {grad_abs:.3e}; logits storage holds the "
                      f"gradient afterwards: {holds_grad}; refusals: {refused}", flush=True)
                self.assertEqual(got_loss.shape, want_loss.shape)
                self.assertEqual(got_loss.dtype, torch.float32)
                self.assertTrue(got_loss.is_contiguous())
                self.assertLessEqual(loss_diff, LOSS_TOL)
                self.assertLessEqual(grad_rel, LOGITS_GRAD_TOL)
                self.assertEqual(got_grad.dtype, torch.bfloat16)
                self.assertEqual(refused, [])
                self.assertEqual(holds_grad, overwrite)

    # -- 2. the whole GPTModel forward/backward ------------------------------------------

    def test_2_gpt_model_forward_backward(self) -> None:
        self.turbo_ce.uninstall()
        self.restore_weights()
        ref_loss, ref_grads, ref_seen = self.model_loss_and_grads()
        again_loss, again_grads, _ = self.model_loss_and_grads()  # Megatron's own run-to-run noise
        noise = max(_rel_err(again_grads[n], ref_grads[n]) for n in ref_grads)
        print(f"[model original] loss {ref_seen['loss_shape']} {ref_seen['loss_dtype']}, logits "
              f"{ref_seen['logits_shape']} {ref_seen['logits_dtype']}, mean loss "
              f"{float(ref_loss.mean()):.5f}; original vs itself: max|dloss| "
              f"{float((again_loss - ref_loss).abs().max()):.3e}, worst param grad rel err "
              f"{noise:.3e}", flush=True)
        grads_by_mode = {}
        for overwrite in (False, True):
            with self.subTest(overwrite_input=overwrite):
                self.install(overwrite)
                try:
                    loss, grads, seen = self.model_loss_and_grads()
                finally:
                    self.turbo_ce.uninstall()
                grads_by_mode[overwrite] = grads
                loss_diff = float((loss - ref_loss).abs().max())
                errs = {n: _rel_err(grads[n], ref_grads[n]) for n in ref_grads}
                worst = max(errs, key=errs.get)
                in_place = seen.get("grad_ptr") == seen.get("logits_ptr")
                print(f"[model overwrite={overwrite}] loss {seen['loss_shape']} "
                      f"{seen['loss_dtype']}, mean {float(loss.mean()):.5f}, max|dloss| "
                      f"{loss_diff:.3e}; {len(errs)} param grads, worst rel err "
                      f"{errs[worst]:.3e} ({worst}), output_layer.weight "
                      f"{errs.get('module.output_layer.weight', float('nan')):.3e}; gradient in the "
                      f"logits' storage: {in_place}; refusals: {seen['refused']}", flush=True)
                self.assertEqual(loss.shape, ref_loss.shape)
                self.assertEqual(loss.dtype, torch.float32)
                self.assertLessEqual(loss_diff, LOSS_TOL)
                self.assertLessEqual(errs[worst], PARAM_GRAD_TOL)
                self.assertTrue(all(torch.isfinite(g).all() for g in grads.values()))
                self.assertEqual(seen["refused"], [])
                self.assertEqual(in_place, overwrite)
        same = max(_rel_err(grads_by_mode[True][n], grads_by_mode[False][n]) for n in ref_grads)
        print(f"[model] overwrite on vs off: worst param grad rel err {same:.3e}", flush=True)

    # -- 3. fallback -----------------------------------------------------------------------

    def test_3_fallback_without_loss_fusion(self) -> None:
        from megatron.core import tensor_parallel

        self.turbo_ce.uninstall()
        self.restore_weights()
        self.config.cross_entropy_loss_fusion = False
        records = _Records()
        logger = logging.getLogger("cegen.megatron")
        logger.addHandler(records)
        real = tensor_parallel.vocab_parallel_cross_entropy
        calls = []

        def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            return real(*args, **kwargs)

        try:
            with torch.no_grad():
                want = self.model(self.input_ids, self.position_ids, None, labels=self.labels)
            self.install(overwrite=False)
            self.turbo_ce.reset_fallback_log()
            tensor_parallel.vocab_parallel_cross_entropy = spy
            got = []
            for _ in range(2):
                with torch.no_grad():
                    got.append(self.model(self.input_ids, self.position_ids, None,
                                          labels=self.labels))
        finally:
            tensor_parallel.vocab_parallel_cross_entropy = real
            self.turbo_ce.uninstall()
            logger.removeHandler(records)
            self.config.cross_entropy_loss_fusion = True
        fallbacks = [m for m in records.messages if "falls back" in m]
        diffs = [float((g - want).abs().max()) for g in got]
        print(f"[fallback] vocab_parallel_cross_entropy called {len(calls)}x over 2 calls; "
              f"log records: {fallbacks}; max|loss - original's| {diffs}", flush=True)
        self.assertEqual(len(calls), 2)
        self.assertEqual(len(fallbacks), 1)
        self.assertIn("cross_entropy_loss_fusion is off", fallbacks[0])
        for diff in diffs:
            self.assertLessEqual(diff, 1e-6)

        off = self.parse(["--cross-entropy-loss-fusion", "--no-use-turbo-cross-entropy"])
        self.assertFalse(self.turbo_ce.install(off))
        self.assertFalse(self.turbo_ce.is_installed())

    # -- 4. training steps -------------------------------------------------------------------

    def train(self, patched: bool, batches,  # type: ignore[no-untyped-def]
              fuse_output_layer: bool = False) -> List[float]:
        self.turbo_ce.uninstall()
        self.restore_weights()
        if patched:
            self.install(overwrite=True, fuse_output_layer=fuse_output_layer)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        losses = []
        try:
            for input_ids, labels in batches:
                optimizer.zero_grad(set_to_none=True)
                loss = self.model(input_ids, self.position_ids, None, labels=labels)
                total = (loss * self.loss_mask).sum() / self.loss_mask.sum()
                total.backward()
                optimizer.step()
                losses.append(float(total))
            self.cegen.check_labels()
        finally:
            self.turbo_ce.uninstall()
            self.restore_weights()
        return losses

    def test_4_training_steps(self) -> None:
        batches = [self.batch() for _ in range(TRAIN_STEPS)]
        self.cegen.reset_overwrite_warnings()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cegen_losses = self.train(True, batches)
        megatron_losses = self.train(False, batches)
        refused = [str(w.message) for w in caught
                   if issubclass(w.category, self.cegen.OverwriteRefusedWarning)]
        diff = max(abs(a - b) for a, b in zip(cegen_losses, megatron_losses))

        def show(xs: List[float]) -> str:
            return f"{xs[0]:.4f} {xs[1]:.4f} {xs[2]:.4f} ... {xs[-2]:.4f} {xs[-1]:.4f}"

        print(f"[train {TRAIN_STEPS} steps AdamW lr 1e-3] cegen (overwrite-input): "
              f"{show(cegen_losses)}", flush=True)
        print(f"[train] megatron: {show(megatron_losses)}; max|diff| {diff:.3e}; refusals: "
              f"{refused}", flush=True)
        self.assertTrue(all(math.isfinite(x) for x in cegen_losses + megatron_losses))
        self.assertLess(cegen_losses[-1], cegen_losses[0])
        self.assertEqual(refused, [])
        self.assertLessEqual(diff, 0.05)


    # -- 6. the fused output layer (issue 18) ---------------------------------------------

    def test_6_fused_output_layer(self) -> None:
        """``--turbo-ce-fuse-output-layer``: GPTModel's post-processing computes the output
        layer and the loss together (``cegen.linear_cross_entropy``, the logits one chunk at
        a time): the output layer's forward never runs, no fallback is logged, the loss and
        every parameter's gradient agree with Megatron's own loss and with the unfused patch,
        and TRAIN_STEPS AdamW steps follow Megatron's loss curve."""
        self.turbo_ce.uninstall()
        self.restore_weights()
        ref_loss, ref_grads, _ = self.model_loss_and_grads()
        self.install(overwrite=True)
        try:
            unfused_loss, unfused_grads, _ = self.model_loss_and_grads()
        finally:
            self.turbo_ce.uninstall()
        records = _Records()
        logger = logging.getLogger("cegen.megatron")
        logger.addHandler(records)
        try:
            self.install(overwrite=True, fuse_output_layer=True)
            self.turbo_ce.reset_fallback_log()
            loss, grads, seen = self.model_loss_and_grads()
        finally:
            self.turbo_ce.uninstall()
            logger.removeHandler(records)
        errs = {n: _rel_err(grads[n], ref_grads[n]) for n in ref_grads}
        worst = max(errs, key=errs.get)
        vs_unfused = max(_rel_err(grads[n], unfused_grads[n]) for n in ref_grads)
        loss_diff = float((loss - ref_loss).abs().max())
        print(f"[fused output layer] loss {tuple(loss.shape)} {loss.dtype}, mean "
              f"{float(loss.mean()):.5f}, max|dloss| vs Megatron {loss_diff:.3e}, vs the unfused "
              f"patch {float((loss - unfused_loss).abs().max()):.3e}; {len(errs)} param grads, "
              f"worst rel err {errs[worst]:.3e} ({worst}), output_layer.weight "
              f"{errs.get('module.output_layer.weight', float('nan')):.3e}, worst vs the unfused "
              f"patch {vs_unfused:.3e}; output layer forward called: {'logits_shape' in seen}; "
              f"log records: {records.messages}", flush=True)
        self.assertNotIn("logits_shape", seen)  # the full logits never existed
        self.assertEqual([m for m in records.messages if "does not fuse" in m], [])
        self.assertEqual(loss.shape, ref_loss.shape)
        self.assertEqual(loss.dtype, torch.float32)
        self.assertLessEqual(loss_diff, LOSS_TOL)
        self.assertLessEqual(errs[worst], PARAM_GRAD_TOL)
        self.assertLessEqual(vs_unfused, PARAM_GRAD_TOL)
        self.assertEqual(set(grads), set(ref_grads))
        self.assertTrue(all(torch.isfinite(g).all() for g in grads.values()))

        batches = [self.batch() for _ in range(TRAIN_STEPS)]
        fused_losses = self.train(True, batches, fuse_output_layer=True)
        megatron_losses = self.train(False, batches)
        diff = max(abs(a - b) for a, b in zip(fused_losses, megatron_losses))
        print(f"[fused output layer, {TRAIN_STEPS} steps AdamW lr 1e-3] "
              f"{fused_losses[0]:.4f} {fused_losses[1]:.4f} ... {fused_losses[-1]:.4f}; "
              f"megatron {megatron_losses[0]:.4f} ... {megatron_losses[-1]:.4f}; max|diff| "
              f"{diff:.3e}", flush=True)
        self.assertTrue(all(math.isfinite(x) for x in fused_losses))
        self.assertLess(fused_losses[-1], fused_losses[0])
        self.assertLessEqual(diff, 0.05)

    # -- 5. SFT: -100 prompt labels masked by loss_mask ------------------------------------

    @classmethod
    def sft_batch(cls) -> Tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
        """Input ids, labels with a -100 prompt of random length per sequence (1/8 to 1/2
        of it), and the loss mask that zeroes the prompt, as Megatron's SFT dataset has it."""
        input_ids, labels = cls.batch()
        prompt = torch.randint(SEQ // 8, SEQ // 2, (BATCH, 1), generator=cls.gen, device="cuda")
        in_prompt = torch.arange(SEQ, device="cuda").unsqueeze(0) < prompt
        labels = labels.masked_fill(in_prompt, -100)
        return input_ids, labels.contiguous(), (~in_prompt).float()

    def test_5_sft_labels(self) -> None:
        records = _Records()
        logger = logging.getLogger("cegen.megatron")
        logger.addHandler(records)
        input_ids, labels, loss_mask = self.sft_batch()
        odd = labels.clone()
        odd[0, 0], odd[1, 1], odd[2, 2] = -1, VOCAB, 2 ** 40  # prompt positions: masked
        try:
            for name, batch_labels in (("-100 prompts", labels), ("-100, -1, V, 2**40", odd)):
                self.turbo_ce.uninstall()
                self.restore_weights()
                with torch.no_grad():
                    want = self.model(input_ids, self.position_ids, None, labels=batch_labels)
                self.install(overwrite=False)
                try:
                    with torch.no_grad():
                        got = self.model(input_ids, self.position_ids, None, labels=batch_labels)
                    torch.cuda.synchronize()
                    self.cegen.check_labels()  # nothing to report: Megatron's labels are valid
                finally:
                    self.turbo_ce.uninstall()
                prompt = batch_labels == -100
                diff = float((got - want).abs().max())
                diff_prompt = float((got - want)[prompt].abs().max())
                masked = float((got * loss_mask).sum() / loss_mask.sum())
                masked_want = float((want * loss_mask).sum() / loss_mask.sum())
                print(f"[sft {name}] {int(prompt.sum())} prompt tokens of {prompt.numel()}; "
                      f"max|dloss| {diff:.3e} (prompt tokens {diff_prompt:.3e}); prompt loss "
                      f"mean {float(got[prompt].mean()):.4f} (Megatron's "
                      f"{float(want[prompt].mean()):.4f}); masked mean {masked:.5f} vs "
                      f"{masked_want:.5f}", flush=True)
                self.assertTrue(bool(torch.isfinite(got).all()))
                self.assertLessEqual(diff, LOSS_TOL)
                self.assertLessEqual(abs(masked - masked_want), LOSS_TOL)
        finally:
            logger.removeHandler(records)
        self.assertEqual([m for m in records.messages if "falls back" in m], [])

        batches = [self.sft_batch() for _ in range(SFT_STEPS)]
        curves = {}
        for patched in (True, False):
            self.turbo_ce.uninstall()
            self.restore_weights()
            if patched:
                self.install(overwrite=True)
            optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            losses = []
            try:
                for step_ids, step_labels, step_mask in batches:
                    optimizer.zero_grad(set_to_none=True)
                    loss = self.model(step_ids, self.position_ids, None, labels=step_labels)
                    total = (loss * step_mask).sum() / step_mask.sum()
                    total.backward()
                    optimizer.step()
                    losses.append(float(total))
                self.cegen.check_labels()
            finally:
                self.turbo_ce.uninstall()
                self.restore_weights()
            curves[patched] = losses
        diff = max(abs(a - b) for a, b in zip(curves[True], curves[False]))
        print(f"[sft train {SFT_STEPS} steps] cegen (overwrite-input): "
              f"{' '.join(f'{x:.4f}' for x in curves[True])}; megatron: "
              f"{' '.join(f'{x:.4f}' for x in curves[False])}; max|diff| {diff:.3e}", flush=True)
        self.assertTrue(all(math.isfinite(x) for x in curves[True] + curves[False]))
        self.assertLessEqual(diff, 0.05)


if __name__ == "__main__":
    if SKIP_REASON is not None:
        print(f"SKIP: {SKIP_REASON}")
    unittest.main(verbosity=2)
