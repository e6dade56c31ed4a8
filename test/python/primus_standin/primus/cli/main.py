"""Stand-in of Primus's command line (``primus/cli/main.py``), for cegen's tests.

``main()`` takes ``train pretrain --config EXP.yaml [overrides...]`` from ``sys.argv``, as
Primus's does, loads the module config, applies the command-line overrides and runs the
``before_train`` patches (train_runtime.py). Instead of training it prints the ids of the
patches it applied (``applied: [...]``), since the tests only need to see what the patches
did.
"""

import argparse
import sys

from primus.core.patches import patch_runner
from primus.core.runtime import train_runtime


def main() -> None:
    parser = argparse.ArgumentParser(prog="primus")
    parser.add_argument("command", choices=["train"])
    parser.add_argument("suite", choices=["pretrain"])
    parser.add_argument("--config", "--exp", dest="config", required=True)
    args, overrides = parser.parse_known_args(sys.argv[1:])
    module_config = train_runtime.load_module_config(args.config, "pre_trainer")
    train_runtime.apply_overrides(module_config, overrides)
    train_runtime.run_before_train(module_config)
    print(f"applied: {patch_runner.APPLIED}")


if __name__ == "__main__":
    main()
