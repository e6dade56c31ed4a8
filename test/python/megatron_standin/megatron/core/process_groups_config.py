"""Stand-in of ProcessGroupCollection and a process group that knows its size."""

from dataclasses import dataclass
from typing import Any, Optional


class FakeProcessGroup:
    """Answers size() and rank() like torch.distributed.ProcessGroup, without a backend."""

    def __init__(self, size: int = 1, rank: int = 0):
        self._size = size
        self._rank = rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@dataclass
class ProcessGroupCollection:
    """The groups LanguageModule reads (tp, cp, pp, embd): FakeProcessGroups, or real
    torch.distributed groups in multi-process tests."""

    tp: Optional[Any] = None
    cp: Optional[FakeProcessGroup] = None
    pp: Optional[FakeProcessGroup] = None
    embd: Optional[FakeProcessGroup] = None

    @staticmethod
    def use_mpu_process_groups() -> "ProcessGroupCollection":
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        if tp is None:
            tp = FakeProcessGroup(parallel_state.get_tensor_model_parallel_world_size())
        return ProcessGroupCollection(tp=tp, cp=FakeProcessGroup(1), pp=FakeProcessGroup(1),
                                      embd=None)
