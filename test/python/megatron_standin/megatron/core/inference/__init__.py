"""Stand-in of Megatron-Core for cegen tests (not Megatron code)."""
