"""Stand-in of transformer_engine.pytorch for cegen tests (not TE code)."""
