"""fsdp-qcomm: ~4-bit weight all-gathers and gradient reduce-scatters for PyTorch FSDP2."""

from .codec import RngKey, wire_bytes
from .config import QCommConfig, QuantSpec
from .fsdp.checkpoint import CheckpointMismatch
from .fsdp.enable import QCommHandle, enable

__all__ = ["CheckpointMismatch", "QCommConfig", "QCommHandle", "QuantSpec", "RngKey", "enable",
           "wire_bytes"]
__version__ = "0.1.0"
