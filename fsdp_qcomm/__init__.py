"""fsdp-qcomm: ~4-bit weight all-gathers and gradient reduce-scatters for PyTorch FSDP2."""

from .codec import RngKey, wire_bytes
from .config import QCommConfig, QuantSpec

__all__ = ["QCommConfig", "QuantSpec", "RngKey", "wire_bytes"]
__version__ = "0.1.0"
