"""Stand-in of megatron.core.inference.utils: the process-wide ``InferenceMode`` flag that
GPTModel._postprocess reads (Megatron-Core's, read at d98e8a64; written for cegen's tests)."""

import contextlib


class InferenceMode:
    """Whether an inference engine is using the model (``is_active``)."""

    _is_active: bool = False

    @classmethod
    def is_active(cls) -> bool:
        return cls._is_active

    @classmethod
    @contextlib.contextmanager
    def active(cls):  # type: ignore[no-untyped-def]
        cls._is_active = True
        try:
            yield
        finally:
            cls._is_active = False
