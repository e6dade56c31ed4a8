"""Stand-in of megatron.training's global arguments (get_args/set_args)."""

_ARGS = None


def set_args(args):
    global _ARGS
    _ARGS = args


def get_args():
    assert _ARGS is not None, "args are not initialized"
    return _ARGS
