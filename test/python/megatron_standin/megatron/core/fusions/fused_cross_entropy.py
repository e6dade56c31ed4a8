"""Stand-in of megatron.core.fusions.fused_cross_entropy (the unfused stand-in's numbers)."""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy_impl

CALLS = {"fused_vocab_parallel_cross_entropy": 0}


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group=None):
    """[s, b, v_local] logits, [s, b] global target -> [s, b] fp32 loss, over ``tp_group``."""
    CALLS["fused_vocab_parallel_cross_entropy"] += 1
    return vocab_parallel_cross_entropy_impl(vocab_parallel_logits, target, 0.0, tp_group)
