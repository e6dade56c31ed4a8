"""Stand-in of Transformer Engine for cegen tests (not TE code): only what Megatron's loss uses."""
