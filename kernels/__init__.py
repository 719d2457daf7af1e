"""Triton kernels of the codec, installed as ``fsdp_qcomm.kernels``.

``fsdp_qcomm.codec`` routes CUDA tensors here; each function has the signature of its torch twin
in ``fsdp_qcomm.codec.torch_codec`` and writes the same bytes (wire format:
``fsdp_qcomm.codec.wire``; the rules that keep the two bit-identical: ``_common``). One fused
kernel per concern:

* ``quantize``: (x - ref) -> optional Hadamard-32 -> scales -> rounding -> packed codes;
* ``dequantize``: codes -> values -> optional inverse Hadamard -> write or add into ``out``;
* ``reduce_requantize``: decode k chunks, sum, re-encode (hop 1 -> hop 2);
* ``reduce_dequantize``: decode k chunks, sum, inverse Hadamard, write (last hop).
"""

from .dequantize import dequantize
from .quantize import quantize
from .reduce_dequantize import reduce_dequantize
from .reduce_requantize import reduce_requantize

__all__ = ["dequantize", "quantize", "reduce_dequantize", "reduce_requantize"]
