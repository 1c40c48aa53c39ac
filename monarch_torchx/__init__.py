"""monarch-torchx: warm pools of hosts for TorchX, submitit and actor meshes.

Kept import-light on purpose: the torchx CLI imports our plugins on every invocation.
"""

__version__ = "0.1.0"
