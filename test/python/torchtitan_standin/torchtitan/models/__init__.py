"""Stand-in of torchtitan.models: the built-in model names."""

_supported_models = frozenset(["llama3"])
