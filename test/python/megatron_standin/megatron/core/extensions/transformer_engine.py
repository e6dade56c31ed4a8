"""Stand-in of megatron.core.extensions.transformer_engine: the TE cross-entropy wrapper.

As in Megatron-Core, ``te_parallel_cross_entropy`` exists where Transformer Engine's
``parallel_cross_entropy`` can be imported (here: the stand-in in
``megatron_standin/transformer_engine``) and calls it without an ignore_idx, so TE's
default -100 applies.
"""

try:
    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

    def te_parallel_cross_entropy(logits, labels, tp_group):
        """Wrapper of TE's cross entropy: [s, b, v_local] logits, [s, b] labels -> [s, b]."""
        return parallel_cross_entropy(logits, labels, 0.0, False, tp_group)

except ImportError:
    te_parallel_cross_entropy = None
