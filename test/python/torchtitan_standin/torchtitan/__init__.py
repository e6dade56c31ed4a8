"""Stand-in of TorchTitan v0.2.2 for cegen tests (not TorchTitan code)."""
