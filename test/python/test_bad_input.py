"""Bad input gets a clear Python exception, never a crash or a silently wrong number."""

from __future__ import annotations

import unittest
from fractions import Fraction

import _support as S
import numpy as np
import torch

import cegen
from cegen import _kernels, _library


class TestRejectedBeforeLaunch(unittest.TestCase):
    """Checked on the Python side: no runtime library needed."""

    def setUp(self) -> None:
        self.logits = S.random_logits((6, 40))
        self.labels = S.random_labels((6,), 40)

    def assert_invalid(self, pattern: str, logits=None, labels=None, **options) -> None:  # type: ignore[no-untyped-def]
        logits = self.logits if logits is None else logits
        labels = self.labels if labels is None else labels
        with self.assertRaisesRegex(cegen.InvalidInputError, pattern) as caught:
            cegen.cross_entropy(logits, labels, **options)
        self.assertIsInstance(caught.exception, ValueError)
        self.assertIsInstance(caught.exception, RuntimeError)

    def test_wrong_device(self) -> None:
        self.assert_invalid("on device meta", logits=torch.empty((6, 40), device="meta"),
                            labels=torch.empty((6,), dtype=torch.int64, device="meta"))
        self.assert_invalid("labels are on meta", labels=torch.empty((6,), dtype=torch.int64, device="meta"))

    def test_wrong_logits_dtype(self) -> None:
        self.assert_invalid("logits dtype torch.float64", logits=self.logits.double())
        self.assert_invalid("logits dtype torch.int64", logits=self.labels.reshape(6, 1))

    def test_wrong_labels_dtype(self) -> None:
        self.assert_invalid("labels dtype torch.float32", labels=self.labels.float())
        self.assert_invalid("labels dtype torch.int16", labels=self.labels.to(torch.int16))

    def test_wrong_shapes(self) -> None:
        self.assert_invalid(r"labels of shape \(5,\)", labels=self.labels[:5])
        self.assert_invalid(r"logits must be \[N, V\] or \[S, B, V\]", logits=self.logits.reshape(2, 3, 4, 10))
        self.assert_invalid(r"logits must be", logits=self.logits.reshape(-1))
        logits3 = S.random_logits((4, 3, 10))
        self.assert_invalid(r"expected \[B, S\] = \(3, 4\)", logits=logits3, labels=S.random_labels((4, 3), 10))
        self.assert_invalid(r"expected \[S, B\] = \(4, 3\)", logits=logits3,
                            labels=S.random_labels((3, 4), 10), label_layout="sb")

    def test_vocabulary_stride(self) -> None:
        self.assert_invalid("vocabulary dimension of the logits must have stride 1",
                            logits=S.random_logits((40, 6)).t())

    def test_bad_options(self) -> None:
        self.assert_invalid(r"label_smoothing must be a real number in \[0, 1\)", label_smoothing=1.0)
        self.assert_invalid(r"label_smoothing must be a real number in \[0, 1\)", label_smoothing=-0.1)
        self.assert_invalid("z_loss must be a finite real number", z_loss=-1e-4)
        self.assert_invalid("z_loss must be a finite real number", z_loss=float("nan"))
        self.assert_invalid("label_layout must be", label_layout="bsv")
        self.assert_invalid("ignore_index must be an int", ignore_index=1.5)
        self.assert_invalid("grad_weights must be", logits=self.logits.clone().requires_grad_(True),
                            grad_weights="mean")

    def test_bad_label_policy(self) -> None:
        pattern = "label_out_of_range must be 'error' .* or 'megatron'"
        for value in ("Megatron", "ignore", "", None, 1):
            with self.subTest(value=value):
                self.assert_invalid(pattern, label_out_of_range=value)
                self.assert_invalid(pattern, logits=self.logits.clone().requires_grad_(True),
                                    grad_weights=1.0, label_out_of_range=value)
                with self.assertRaisesRegex(cegen.InvalidInputError, pattern):
                    cegen.vocab_parallel_cross_entropy(self.logits, self.labels,
                                                       label_out_of_range=value)
                with self.assertRaisesRegex(cegen.InvalidInputError, "label_out_of_range must be"):
                    cegen.combine_shard_stats(
                        torch.zeros(1, 6, 4), self.labels, ignore_index=None, label_smoothing=0.0,
                        z_loss=0.0, vocab_local=40, vocab=40, global_smoothing=False, rank=0,
                        label_out_of_range=value)

    def test_bad_upstream_gradient_shape(self) -> None:
        with self.assertRaisesRegex(cegen.InvalidInputError, "grad_loss has shape"):
            _kernels.backward(self.logits, self.labels, torch.zeros(6), torch.zeros(5),
                              _kernels.KernelOptions(), overwrite=False)

    def test_not_tensors(self) -> None:
        with self.assertRaisesRegex(cegen.InvalidInputError, "torch.Tensor"):
            cegen.cross_entropy([[1.0, 2.0]], torch.tensor([0]))  # type: ignore[arg-type]


class TestOptionValues(unittest.TestCase):
    """Every option value is checked in cegen._validate: a bad one is an InvalidInputError
    naming the argument, the value and what is allowed, before anything runs (issue 23,
    item 10); the integer and real types callers use (NumPy, 0-d tensors) are accepted."""

    def setUp(self) -> None:
        self.logits = S.random_logits((6, 40))
        self.labels = S.random_labels((6,), 40)

    def assert_refused(self, call, *parts: str) -> cegen.InvalidInputError:  # type: ignore[no-untyped-def]
        with self.assertRaises(cegen.InvalidInputError) as caught:
            call()
        message = str(caught.exception)
        for part in parts:
            self.assertIn(part, message)
        self.assertIsInstance(caught.exception, ValueError)
        return caught.exception

    def refused_everywhere(self, option: str, value, *parts: str) -> None:  # type: ignore[no-untyped-def]
        """The option is refused by each entry point that takes it."""
        x = self.logits.clone().requires_grad_(True)
        calls = {
            "cross_entropy": lambda: cegen.cross_entropy(self.logits, self.labels, **{option: value}),
            "fused": lambda: cegen.cross_entropy(x, self.labels, grad_weights=1.0, **{option: value}),
            "vocab_parallel": lambda: cegen.vocab_parallel_cross_entropy(
                self.logits, self.labels, **{option: value}),
            "linear": lambda: cegen.linear_cross_entropy(
                torch.randn(6, 4), torch.randn(40, 4), self.labels, **{option: value}),
        }
        for name, call in calls.items():
            with self.subTest(entry_point=name, option=option, value=value):
                self.assert_refused(call, f"{option} must be", *parts)

    def test_label_smoothing(self) -> None:
        allowed = "a real number in [0, 1) (at most 0.99999994 in float32)"
        self.refused_everywhere("label_smoothing", None, allowed, "got None")
        self.refused_everywhere("label_smoothing", "0.1", allowed, "got '0.1'")
        self.refused_everywhere("label_smoothing", True, allowed, "got True")
        self.refused_everywhere("label_smoothing", float("nan"), allowed, "got nan")
        self.refused_everywhere("label_smoothing", torch.tensor([0.1]), allowed, "shape (1,)")
        # In [0, 1) as a Python float, but 1 once rounded to the float32 the kernels get.
        self.refused_everywhere("label_smoothing", 0.99999999, "got 0.99999999, which rounds to 1 in float32")
        for value in (np.float32(0.25), np.float64(0.25), torch.tensor(0.25), 0.25, Fraction(1, 4)):
            with self.subTest(value=value):
                self.assertEqual(_kernels.KernelOptions(label_smoothing=value).label_smoothing, 0.25)

    def test_z_loss(self) -> None:
        allowed = "a finite real number in [0, 3.40282347e+38] (the largest float32)"
        self.refused_everywhere("z_loss", 1e39, allowed, "got 1e+39")
        self.refused_everywhere("z_loss", float("inf"), allowed, "got inf")
        self.refused_everywhere("z_loss", None, allowed, "got None")
        self.refused_everywhere("z_loss", 10 ** 400, allowed)  # too large for a float at all
        largest = _kernels.KernelOptions(z_loss=3.4028235e38).z_loss  # rounds to the largest float32
        self.assertEqual(largest, 3.4028234663852886e38)
        self.assertEqual(_kernels.KernelOptions(z_loss=np.float16(0.5)).z_loss, 0.5)

    def test_ignore_index(self) -> None:
        allowed = "an integer in [-9223372036854775808, 9223372036854775807] or None"
        self.refused_everywhere("ignore_index", 2 ** 64, allowed, "got 18446744073709551616")
        self.refused_everywhere("ignore_index", -(2 ** 63) - 1, allowed)
        self.refused_everywhere("ignore_index", 1.0, allowed, "got 1.0")
        self.refused_everywhere("ignore_index", True, allowed, "got True")
        self.refused_everywhere("ignore_index", "-100", allowed, "got '-100'")
        self.refused_everywhere("ignore_index", np.uint64(2 ** 64 - 1), allowed)
        self.refused_everywhere("ignore_index", torch.tensor([-100]), allowed, "a tensor of shape (1,)")
        # Any integer type: Python's, NumPy's, a 0-d integer tensor; kept as a Python int so
        # that the custom ops' schema (int?) and the variant key see the same value.
        for value in (np.int64(-100), np.int32(-100), np.int8(-100), torch.tensor(-100), -100):
            with self.subTest(value=value):
                options = _kernels.KernelOptions(ignore_index=value)
                self.assertIs(type(options.ignore_index), int)
                self.assertEqual(options.ignore_index, -100)
        for edge in (2 ** 63 - 1, -(2 ** 63)):
            self.assertEqual(_kernels.KernelOptions(ignore_index=edge).ignore_index, edge)

    def test_choices(self) -> None:
        self.refused_everywhere("label_layout", None, "'bs' (labels [B, S]) or 'sb' (labels [S, B])",
                                "got None")
        self.refused_everywhere("label_out_of_range", "Error", "'error' (", "or 'megatron' (",
                                "got 'Error'")

    def test_flags(self) -> None:
        x = self.logits.clone().requires_grad_(True)
        for value in ("no", "False", 0, 1, None):
            with self.subTest(value=value):
                # "no" is truthy: it must not overwrite the logits.
                self.assert_refused(lambda: cegen.cross_entropy(x, self.labels, overwrite_input=value),
                                    "overwrite_input must be True or False", f"got {value!r}")
                self.assert_refused(
                    lambda: cegen.vocab_parallel_cross_entropy(self.logits, self.labels,
                                                               global_smoothing=value),
                    "global_smoothing must be True or False")
        self.assertFalse(_kernels.Shard(0, 8, np.bool_(False)).global_smoothing)

    def test_grad_weights(self) -> None:
        x = self.logits.clone().requires_grad_(True)
        allowed = "grad_weights must be a finite real number in float32's range [-3.40282347e+38, 3.40282347e+38]"
        for value in (1e39, -1e39, float("nan"), float("inf"), "mean", [1.0], True):
            with self.subTest(value=value):
                self.assert_refused(lambda: cegen.cross_entropy(x, self.labels, grad_weights=value),
                                    allowed, f"got {value!r}")
                # Refused when no gradient is needed too, rather than ignored.
                self.assert_refused(lambda: cegen.cross_entropy(self.logits, self.labels,
                                                                grad_weights=value), allowed)
                self.assert_refused(lambda: cegen.linear_cross_entropy(
                    torch.randn(6, 4), torch.randn(40, 4), self.labels, grad_weights=value), allowed)
        self.assert_refused(lambda: cegen.cross_entropy(x, self.labels, grad_weights=torch.ones(6, dtype=torch.int64)),
                            "grad_weights must be floating point")

    def test_bundle_paths(self) -> None:
        for value, shown in (("", "''"), ("dir\0name", "'dir\\x00name'"), (42, "42"),
                             (["a"], "['a']")):
            with self.subTest(value=value):
                self.assert_refused(lambda: cegen.cross_entropy(self.logits, self.labels, bundle=value),
                                    "bundle must be a path (str or os.PathLike)", f"got {shown}")
                self.assert_refused(lambda: cegen.linear_cross_entropy(
                    torch.randn(6, 4), torch.randn(40, 4), self.labels, bundle=value),
                    "bundle must be a path")

    def test_shard_and_combine(self) -> None:
        shard = _kernels.Shard(np.int64(8), np.int32(16))
        self.assertEqual((shard.start, shard.vocab), (8, 16))
        self.assertIs(type(shard.start), int)
        self.assert_refused(lambda: _kernels.Shard(0, 2 ** 64), "shard vocab must be an integer in [1, ")
        self.assert_refused(lambda: _kernels.Shard(16, 16), "shard start must be an integer in [0, 15], got 16")
        self.assert_refused(lambda: _kernels.Shard(True, 16), "shard start must be", "got True")
        combine = dict(ignore_index=None, label_smoothing=0.0, z_loss=0.0, vocab_local=40, vocab=40,
                       global_smoothing=False, rank=0)
        stats = torch.zeros(1, 6, 4)
        for option, value, message in (("label_smoothing", None, "label_smoothing must be"),
                                       ("z_loss", 1e39, "z_loss must be"),
                                       ("ignore_index", 2 ** 64, "ignore_index must be"),
                                       ("vocab_local", 41, "vocab_local must be an integer in [1, 40]"),
                                       ("vocab", 2.0, "vocab must be an integer"),
                                       ("rank", None, "rank must be an integer"),
                                       ("global_smoothing", "yes", "global_smoothing must be True or False")):
            with self.subTest(option=option):
                self.assert_refused(lambda: cegen.combine_shard_stats(
                    stats, self.labels, **{**combine, option: value}), message)

    def test_chunk_tokens(self) -> None:
        for value in (0, 2.5, "64", True):
            with self.subTest(value=value):
                self.assert_refused(lambda: cegen.linear_cross_entropy(
                    torch.randn(6, 4), torch.randn(40, 4), self.labels, chunk_tokens=value),
                    "chunk_tokens must be an integer in [1, 9223372036854775807] or None", f"got {value!r}")

    def test_configure(self) -> None:
        previous = cegen.get_config()
        cases = (("cache_dir", None, "cache_dir must be a path"),
                 ("bundle_dirs", None, "bundle_dirs must be a path or a list of paths"),
                 ("bundle_dirs", ["ok", 3], "bundle_dirs[1] must be a path"),
                 ("ce_gen", "", "ce_gen must be a path"),
                 ("run_ce_gen", "no", "run_ce_gen must be True or False, got 'no'"),
                 ("ce_gen_timeout_s", 0, "ce_gen_timeout_s must be a finite number of seconds > 0, got 0"),
                 ("ce_gen_timeout_s", float("inf"), "ce_gen_timeout_s must be a finite number"),
                 ("cache_max_bytes", -1, "cache_max_bytes must be an integer in [0, "),
                 ("cache_max_bytes", 1.5, "cache_max_bytes must be an integer"))
        for name, value, message in cases:
            with self.subTest(setting=name, value=value):
                self.assert_refused(lambda: cegen.configure(**{name: value}), message)
                self.assertEqual(cegen.get_config(), previous)  # nothing changed
        self.assertEqual(cegen.configure(cache_max_bytes=np.int64(5)).cache_max_bytes, 5)
        cegen.configure(cache_max_bytes=previous.cache_max_bytes)


class TestFakeImplementations(unittest.TestCase):
    """The shape functions behind the custom ops' fake (meta) kernels."""

    def test_shapes_and_dtypes(self) -> None:
        logits = torch.empty((5, 3, 11), dtype=torch.bfloat16, device="meta")
        labels = torch.empty((3, 5), dtype=torch.int64, device="meta")
        loss, lse, low = _library.forward_fake(logits, labels, None, 0.0, 0.0, "bs", None, "error",
                                               1.0, 0.0)
        self.assertEqual((tuple(loss.shape), loss.dtype, loss.device.type), ((3, 5), torch.float32, "meta"))
        self.assertEqual(tuple(lse.shape), (3, 5))
        self.assertEqual((tuple(low.shape), low.dtype), ((3, 5), torch.float32))
        grad = _library.backward_fake(logits, labels, lse, low, loss, None, 0.0, 0.0, "bs", None,
                                      "megatron", 2.0, 30.0)
        self.assertEqual((tuple(grad.shape), grad.dtype), ((5, 3, 11), torch.bfloat16))
        loss, lse, grad = _library.fused_fake(logits, labels, torch.empty((), device="meta"), None, 0.0,
                                              0.0, "sb", None, "megatron", 0.5, 0.0)
        self.assertEqual(tuple(loss.shape), (5, 3))
        self.assertEqual(tuple(grad.shape), (5, 3, 11))
        self.assertIsNone(_library.backward_overwrite_fake(logits, labels, lse, low, loss, None, 0.0,
                                                           0.0, "bs", None, "error", 1.0,
                                                           0.0))
        flat = torch.empty((7, 11), dtype=torch.float16, device="meta")
        loss, _ = _library.fused_overwrite_fake(flat, torch.empty((7,), dtype=torch.int32, device="meta"),
                                                torch.empty((), device="meta"), None, 0.0, 0.0, "bs", None,
                                                "megatron", 1.0, 0.0)
        self.assertEqual(tuple(loss.shape), (7,))

    def test_every_op_takes_the_label_policy_and_logit_scale(self) -> None:
        import inspect

        for name, impl, fake, _ in _library._SPECS:
            for function in (impl, fake):
                with self.subTest(op=name, function=function.__name__):
                    parameters = list(inspect.signature(function).parameters)
                    self.assertEqual(parameters[-3:],
                                     ["label_out_of_range", "logit_scale", "logit_softcap"])
            if cegen.HAS_CUSTOM_OP:
                schema = str(getattr(torch.ops.cegen, name).default._schema)
                self.assertIn("str label_out_of_range, float logit_scale, float logit_softcap",
                              schema)

    def test_mutation_is_declared(self) -> None:
        mutated = {name: mutates for name, _, _, mutates in _library._SPECS}
        self.assertEqual(mutated["backward_overwrite"], ("logits",))
        self.assertEqual(mutated["fused_overwrite"], ("logits",))
        self.assertEqual(mutated["forward"], ())
        if cegen.HAS_CUSTOM_OP:
            schema = str(torch.ops.cegen.backward_overwrite.default._schema)
            self.assertIn("Tensor(a0!) logits", schema)


@unittest.skipUnless(cegen.runtime_available(), "libce_runtime.so is not built")
class TestLabelPolicyThreading(unittest.TestCase):
    """label_out_of_range reaches ce_options.label_policy and selects no other variant."""

    def test_runtime_options(self) -> None:
        strict = _kernels._runtime_options(_kernels.KernelOptions(), overwrite=False)
        self.assertEqual(strict.label_policy, cegen._runtime.LabelPolicy.STRICT)
        megatron = _kernels.KernelOptions(ignore_index=-100, label_out_of_range="megatron",
                                          shard=_kernels.Shard(4, 8))
        threaded = _kernels._runtime_options(megatron, overwrite=True)
        self.assertEqual(threaded.label_policy, cegen._runtime.LabelPolicy.MEGATRON)
        self.assertEqual((threaded.has_ignore_index, threaded.ignore_index), (1, -100))
        self.assertEqual((threaded.shard_start, threaded.shard_vocab), (4, 8))
        # The logit scale (issue 17) reaches ce_options.logit_scale; 1 by default.
        self.assertEqual(strict.logit_scale, 1.0)
        scaled = _kernels._runtime_options(_kernels.KernelOptions(logit_scale=0.5), False)
        self.assertEqual(scaled.logit_scale, 0.5)

    def test_not_part_of_the_variant_key(self) -> None:
        logits, labels = S.random_logits((3, 8)), S.random_labels((3,), 8)
        keys = {str(_kernels._key("forward", logits, labels,
                                  _kernels.KernelOptions(label_out_of_range=policy)))
                for policy in ("error", "megatron")}
        self.assertEqual(len(keys), 1)


class TestVariantKeys(unittest.TestCase):
    """Keys spelled as ce::KernelVariantKey::str() spells them."""

    def test_spelling(self) -> None:
        key = cegen.VariantKey("forward", "bf16", "i64", "sbv_bs")
        self.assertEqual(str(key), "op=forward,logits=bf16,labels=i64,layout=sbv_bs,"
                                   "label_smoothing=off,z_loss=off,overwrite=0,weights=none")
        key = cegen.VariantKey("fused", "f32", "i32", "flat", True, True, True, "token")
        self.assertEqual(str(key), "op=fused,logits=f32,labels=i32,layout=flat,"
                                   "label_smoothing=on,z_loss=on,overwrite=1,weights=token")

    def test_ce_gen_options(self) -> None:
        key = cegen.VariantKey("backward", "f16", "i64", "sbv_sb", True, False, True)
        self.assertEqual(key.ce_gen_options(), [
            "--variant=op=backward,logits=f16,labels=i64,layout=sbv_sb,"
            "label_smoothing=on,z_loss=off,overwrite=1,weights=none"])

    def test_serving_keys(self) -> None:
        # The runtime's findServingKernel order: the key, then "on" kernels for a 0.
        key = cegen.VariantKey("forward", "f32", "i64", "flat")
        self.assertEqual([(k.label_smoothing, k.z_loss) for k in key.serving_keys()],
                         [(False, False), (True, False), (False, True), (True, True)])
        key = cegen.VariantKey("shard_stats", "f32", "i64", "flat")
        self.assertEqual([(k.label_smoothing, k.z_loss) for k in key.serving_keys()],
                         [(False, False), (True, False)])

    def test_rejects_inconsistent_keys(self) -> None:
        with self.assertRaises(ValueError):
            cegen.VariantKey("fused", "f32", "i64", "flat")  # fused needs weights
        with self.assertRaises(ValueError):
            cegen.VariantKey("forward", "f64", "i64", "flat")
        with self.assertRaises(ValueError):
            cegen.VariantKey("forward", "f32", "i64", "flat", overwrite=True)
        with self.assertRaises(ValueError):
            cegen.VariantKey("shard_stats", "f32", "i64", "flat", z_loss=True)
        with self.assertRaises(ValueError):
            cegen.VariantKey("fused", "f32", "i64", "flat", weights="scalar")
        # Option values are not part of a key: its fields are flags.
        for field, value in (("label_smoothing", 0.1), ("z_loss", 1e-4),
                             ("overwrite", "no")):
            with self.subTest(field=field):
                with self.assertRaisesRegex(cegen.InvalidInputError,
                                            f"{field} must be True or False"):
                    cegen.VariantKey("backward", "f32", "i64", "flat", **{field: value})


class TestConfiguration(unittest.TestCase):
    def test_unknown_setting(self) -> None:
        with self.assertRaisesRegex(TypeError, "unknown setting"):
            cegen.configure(cache_directory="/tmp")

    def test_missing_runtime_library_path(self) -> None:
        with self.assertRaisesRegex(cegen.RuntimeLibraryError, "no file"):
            cegen.set_runtime_library("/nonexistent/libce_runtime.so")

    def test_ce_gen_disabled_and_absent(self) -> None:
        previous = cegen.get_config()
        try:
            cegen.configure(ce_gen="/nonexistent/ce-gen")
            self.assertIsNone(cegen.find_ce_gen())
        finally:
            cegen.configure(ce_gen=previous.ce_gen)


@S.requires_kernels
class TestRejectedByTheRuntime(unittest.TestCase):
    """Labels out of range are found by the kernels and reported by the runtime."""

    def test_label_out_of_range(self) -> None:
        logits = S.random_logits((6, 40)).requires_grad_(True)
        for bad in (40, 1000, -1, -100):
            labels = S.random_labels((6,), 40)
            labels[4] = bad
            with self.subTest(label=bad):
                with self.assertRaises(cegen.LabelOutOfRangeError) as caught:
                    cegen.cross_entropy(logits, labels)
                self.assertIsInstance(caught.exception, ValueError)
                self.assertEqual(caught.exception.status, 4)
                self.assertIn(str(bad), str(caught.exception))

    def test_ignore_index_is_not_out_of_range(self) -> None:
        labels = S.random_labels((6,), 40)
        labels[2] = -100
        loss = cegen.cross_entropy(S.random_logits((6, 40)), labels, ignore_index=-100)
        self.assertEqual(float(loss[2]), 0.0)
        labels[3] = -1
        with self.assertRaises(cegen.LabelOutOfRangeError):
            cegen.cross_entropy(S.random_logits((6, 40)), labels, ignore_index=-100)

    def test_wide_ignore_index_is_not_truncated_for_int32_labels(self) -> None:
        # 2**32 - 100 is -100 in 32 bits: it must match no int32 label, -100 included.
        labels = S.random_labels((6,), 40, torch.int32)
        labels[1] = -100
        for ignore_index in (2 ** 32 - 100, np.int64(-100 - 2 ** 32)):
            with self.subTest(ignore_index=ignore_index):
                with self.assertRaisesRegex(cegen.LabelOutOfRangeError, "label -100 is not in"):
                    cegen.cross_entropy(S.random_logits((6, 40)), labels, ignore_index=ignore_index)
        loss = cegen.cross_entropy(S.random_logits((6, 40)), labels, ignore_index=np.int16(-100))
        self.assertEqual(float(loss[1]), 0.0)

    def test_out_of_range_in_fused_mode(self) -> None:
        labels = S.random_labels((2, 3), 40)
        labels[1, 2] = 40
        with self.assertRaises(cegen.LabelOutOfRangeError):
            cegen.cross_entropy(S.random_logits((3, 2, 40)).requires_grad_(True), labels, grad_weights=1.0)


if __name__ == "__main__":
    unittest.main()
