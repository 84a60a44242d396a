"""titanlite: a lean, TorchTitan-style pretraining codebase built around one DeviceMesh."""

__version__ = "0.1.0"
