"""Stand-in of torchtitan.tools.logging: TorchTitan logs to the root logger."""

import logging

logger = logging.getLogger()
