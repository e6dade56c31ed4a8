"""Stand-in of LanguageModule for cegen tests (not Megatron code)."""
