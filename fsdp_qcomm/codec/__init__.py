"""Quantization codec: flat tensors to compact wire rows and back (format in ``wire.py``).

Every function takes tensors of shape ``[..., n]`` whose leading dims are rows encoded
independently (one per destination or source rank), and dispatches on the device: CUDA tensors
run the Triton kernels in ``fsdp_qcomm.kernels``, everything else the torch implementation in
``torch_codec``. Both write the same bytes.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..config import QuantSpec
from . import torch_codec
from .rng import RngKey
from .wire import bits_per_element, hadamard_len, wire_bytes

Chunks = Union[torch.Tensor, Sequence[torch.Tensor]]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _impl(t: torch.Tensor):
    if t.is_cuda:
        from .. import kernels  # imported lazily: triton is only needed on GPUs

        return kernels
    return torch_codec


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} must be float32/bfloat16/float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension")
    return x.reshape(-1, x.shape[-1])


def _check_wire(data: torch.Tensor, n: int, spec: QuantSpec, what: str) -> torch.Tensor:
    if data.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8 wire bytes, got {data.dtype}")
    expect = wire_bytes(n, spec)
    if data.shape[-1] != expect:
        raise ValueError(
            f"{what} rows have {data.shape[-1]} bytes but {n} values under {spec} take {expect}"
        )
    return data.reshape(-1, expect)


def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    key: Optional[RngKey] = None,
    *,
    ref: Optional[torch.Tensor] = None,
    hadamard: bool = False,
) -> torch.Tensor:
    """Encode rows of ``x`` (or ``x - ref``; or ``H32 x`` padded to whole 32-blocks).

    Returns uint8 of shape ``x.shape[:-1] + (wire_bytes(m, spec),)`` with ``m = n`` or
    ``hadamard_len(n)``. ``key`` is required for stochastic rounding.
    """
    if spec.stochastic and key is None:
        raise ValueError(
            f"{spec} rounds stochastically and needs key=RngKey(seed, step, rank, bucket)"
        )
    rows = _rows(x, "x")
    r = None
    if ref is not None:
        if ref.shape != x.shape:
            raise ValueError(f"ref shape {tuple(ref.shape)} must equal x shape {tuple(x.shape)}")
        r = _rows(ref, "ref")
    out = _impl(x).quantize(rows, spec, key, r, hadamard)
    return out.view(*x.shape[:-1], out.shape[-1])


def dequantize(
    data: torch.Tensor,
    n: int,
    spec: QuantSpec,
    *,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Decode wire rows into ``[..., n]`` fp32 (or into ``out``; ``accumulate`` adds)."""
    m = hadamard_len(n) if hadamard else n
    rows = _check_wire(data, m, spec, "data")
    o = None
    if out is not None:
        if out.numel() != rows.shape[0] * n or out.shape[-1] != n:
            raise ValueError(
                f"out shape {tuple(out.shape)} does not hold {rows.shape[0]} rows of {n}"
            )
        o = out.view(-1, n)
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the tensor to add into)")
    res = _impl(data).dequantize(rows, n, spec, hadamard, o, accumulate)
    return out if out is not None else res.view(*data.shape[:-1], n)


def _chunk_list(chunks: Chunks, n: int, spec: QuantSpec) -> list[torch.Tensor]:
    seq = list(chunks.unbind(0)) if isinstance(chunks, torch.Tensor) else list(chunks)
    if not seq:
        raise ValueError("need at least one chunk to reduce")
    shape = seq[0].shape
    for c in seq:
        if c.shape != shape:
            raise ValueError(
                f"all chunks must share one shape, got {tuple(shape)} and {tuple(c.shape)}"
            )
    return [_check_wire(c, n, spec, "chunk") for c in seq]


def reduce_requantize(
    chunks: Chunks, n: int, spec_in: QuantSpec, spec_out: QuantSpec, key: Optional[RngKey] = None
) -> torch.Tensor:
    """Decode k wire blocks, sum them in fp32 (in order), re-encode with ``spec_out``.

    ``n`` is the row length as encoded (already ``hadamard_len``-padded where Hadamard is used);
    the Hadamard rotation is kept, since sums commute with it.
    """
    seq = _chunk_list(chunks, n, spec_in)
    if spec_out.stochastic and key is None:
        raise ValueError(f"{spec_out} rounds stochastically and needs key=RngKey(...)")
    shape = (chunks.shape[1:-1] if isinstance(chunks, torch.Tensor) else chunks[0].shape[:-1])
    out = _impl(seq[0]).reduce_requantize(seq, n, spec_in, spec_out, key)
    return out.view(*shape, out.shape[-1])


def reduce_dequantize(
    chunks: Chunks,
    n: int,
    spec: QuantSpec,
    *,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode k wire blocks, sum in fp32 (in order), undo the Hadamard once, keep ``n`` values."""
    m = hadamard_len(n) if hadamard else n
    seq = _chunk_list(chunks, m, spec)
    shape = (chunks.shape[1:-1] if isinstance(chunks, torch.Tensor) else chunks[0].shape[:-1])
    o = out.view(-1, n) if out is not None else None
    res = _impl(seq[0]).reduce_dequantize(seq, n, spec, hadamard, o)
    return out if out is not None else res.view(*shape, n)


__all__ = [
    "RngKey",
    "bits_per_element",
    "dequantize",
    "hadamard_len",
    "quantize",
    "reduce_dequantize",
    "reduce_requantize",
    "wire_bytes",
]
