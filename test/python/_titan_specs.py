"""The module a TorchTitan user names in ``--experimental.custom_import`` (for test_torchtitan.py).

It registers ``llama3_cegen``: TorchTitan's llama3 TrainSpec with cegen's loss.
"""

from cegen import torchtitan as cegen_titan

cegen_titan.register_train_spec("llama3")
