"""Stand-in of megatron.core.parallel_state: a single-process world, TP size configurable."""

_tensor_model_parallel_world_size = 1


def set_tensor_model_parallel_world_size(size: int) -> None:
    """Test hook: the TP size the global state reports."""
    global _tensor_model_parallel_world_size
    _tensor_model_parallel_world_size = size


def get_tensor_model_parallel_world_size() -> int:
    return _tensor_model_parallel_world_size


def get_tensor_model_parallel_rank() -> int:
    return 0
