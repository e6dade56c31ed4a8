"""Stand-in of megatron.core.fusions.fused_cross_entropy (single rank, for tests)."""

from megatron.core.tensor_parallel.cross_entropy import _single_rank_cross_entropy

CALLS = {"fused_vocab_parallel_cross_entropy": 0}


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group=None):
    """[s, b, v] logits, [s, b] target -> [s, b] fp32 loss."""
    CALLS["fused_vocab_parallel_cross_entropy"] += 1
    return _single_rank_cross_entropy(vocab_parallel_logits, target)
