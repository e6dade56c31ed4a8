"""Stand-in of Megatron-Core's ``num_microbatches_calculator``: the current number of
micro-batches (``get_num_microbatches``), set by the tests (``set_num_microbatches``)."""

_NUM_MICROBATCHES = 1


def get_num_microbatches() -> int:
    return _NUM_MICROBATCHES


def set_num_microbatches(value: int) -> None:
    """Test hook (Megatron's calculator is set up by ``init_num_microbatches_calculator``)."""
    global _NUM_MICROBATCHES
    _NUM_MICROBATCHES = int(value)
