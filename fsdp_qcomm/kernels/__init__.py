"""Triton kernels of the codec (``fsdp_qcomm.kernels``).

``fsdp_qcomm.codec`` routes CUDA tensors here; each function has the signature of its torch twin
in ``fsdp_qcomm.codec.torch_codec`` (or ``codec.levels`` for learned levels) and writes the same
bytes (wire format: ``fsdp_qcomm.codec.wire``; the rules that keep them bit-identical:
``_common``). One fused kernel per concern:

* ``quantize``: (x - ref) -> optional Hadamard-32 -> scales -> rounding -> packed codes;
* ``dequantize``: codes -> values -> optional inverse Hadamard -> write or add into ``out``;
* ``reduce_requantize``: decode k chunks, sum, re-encode (hop 1 -> hop 2);
* ``reduce_dequantize``: decode k chunks, sum, inverse Hadamard, write (last hop);
* ``levels``: learned (non-uniform) level tables, encode and decode-sum;
* ``digest``: the change tracker's exact shard digest, one pass (not part of the wire format).

Where the sources live. The kernel modules sit in the repository's top-level ``kernels/``
folder (no ``__init__.py``: it is not a package of its own, so a checkout on ``sys.path``
never shadows another distribution's ``kernels``, such as Hugging Face's). A built wheel copies
them next to this file (``setup.py``); in a source checkout or an editable install this package
adds that folder to its ``__path__``, so ``fsdp_qcomm.kernels.quantize`` is
``kernels/quantize.py`` either way.
"""

from pathlib import Path as _Path

_HERE = _Path(__file__).resolve().parent
if not (_HERE / "_common.py").is_file():  # a source checkout: the sources are in <root>/kernels
    _SRC = _HERE.parents[1] / "kernels"
    if not (_HERE.parents[1] / "pyproject.toml").is_file() or not (_SRC / "_common.py").is_file():
        raise ImportError(
            f"fsdp_qcomm.kernels: the kernel sources are neither in {_HERE} (an installed wheel) "
            f"nor in {_SRC} (a source checkout); reinstall fsdp-qcomm"
        )
    __path__.append(str(_SRC))  # noqa: F821 - __path__ is set by the import system

from .dequantize import dequantize, dequantize_segments  # noqa: E402
from .digest import digest_many  # noqa: E402
from .levels import dequantize_levels_sum, quantize_levels  # noqa: E402
from .quantize import quantize, quantize_ordered, quantize_segments  # noqa: E402
from .reduce_dequantize import reduce_dequantize  # noqa: E402
from .reduce_requantize import reduce_requantize  # noqa: E402

__all__ = [
    "dequantize",
    "dequantize_segments",
    "dequantize_levels_sum",
    "digest_many",
    "quantize",
    "quantize_levels",
    "quantize_ordered",
    "quantize_segments",
    "reduce_dequantize",
    "reduce_requantize",
]
