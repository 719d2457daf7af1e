"""fsdp-qcomm: ~4-bit weight all-gathers and gradient reduce-scatters for PyTorch FSDP2.

The public API is what this module exports: ``enable`` (install the quantized collectives on a
``fully_shard``-ed model) and the ``QCommHandle`` it returns, the configuration (``QCommConfig``
with its presets, ``QuantSpec`` for one wire format), ``wire_bytes`` and ``RngKey`` (the wire
format's size and the quantizer's random stream), and the errors a user may catch
(``FSDPInternalsChanged``: this torch's FSDP2 is not what fsdp-qcomm was written against;
``CheckpointMismatch``: a saved handle state that does not belong to this run). Beside it, each
a public subpackage with its own documented entry points: ``fsdp_qcomm.diloco`` (DiLoCo across
sites), ``fsdp_qcomm.integrations`` (Accelerate, Lightning), ``fsdp_qcomm.titan`` and
``fsdp_qcomm.titan03`` (torchtitan). Everything else (``codec``, ``collectives``, ``fsdp``,
``kernels``, ``titan_common``, ``stats``, ``testing``) is internal: importable, but not a stable
interface.
"""

from .codec import RngKey, wire_bytes
from .config import QCommConfig, QuantSpec
from .fsdp.checkpoint import CheckpointMismatch
from .fsdp.enable import QCommHandle, enable
from .fsdp.internals import FSDPInternalsChanged

__all__ = ["CheckpointMismatch", "FSDPInternalsChanged", "QCommConfig", "QCommHandle",
           "QuantSpec", "RngKey", "enable", "wire_bytes"]
__version__ = "0.1.0"
