"""Stand-in of flash-attention's ``flash_attn`` package for cegen's compatibility run (not
flash-attention code): only ``flash_attn.losses.cross_entropy.CrossEntropyLoss``, computed by
cegen (issue 17; test/compat/run_flash_attn_tests.py)."""
