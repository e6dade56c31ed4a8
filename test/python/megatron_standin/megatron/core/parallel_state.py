"""Stand-in of megatron.core.parallel_state: the tensor-parallel group and its size.

Tests either set a size (a single-process world that only reports it) or a real
``torch.distributed`` group (multi-process tests), as ``initialize_model_parallel`` would.
"""

_tensor_model_parallel_world_size = 1
_TENSOR_MODEL_PARALLEL_GROUP = None


def set_tensor_model_parallel_world_size(size: int) -> None:
    """Test hook: the TP size the global state reports when no group is set."""
    global _tensor_model_parallel_world_size
    _tensor_model_parallel_world_size = size


def set_tensor_model_parallel_group(group) -> None:
    """Test hook: the tensor-parallel group (a torch.distributed group, or None)."""
    global _TENSOR_MODEL_PARALLEL_GROUP
    _TENSOR_MODEL_PARALLEL_GROUP = group


def get_tensor_model_parallel_group(check_initialized=True):
    if check_initialized:
        assert _TENSOR_MODEL_PARALLEL_GROUP is not None, "tensor model parallel group is not initialized"
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_world_size() -> int:
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return _TENSOR_MODEL_PARALLEL_GROUP.size()
    return _tensor_model_parallel_world_size


def get_tensor_model_parallel_rank() -> int:
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return _TENSOR_MODEL_PARALLEL_GROUP.rank()
    return 0
