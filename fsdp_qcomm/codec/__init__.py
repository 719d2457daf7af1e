"""Quantization codec: flat tensors to compact wire rows and back (format in ``wire.py``).

Every function takes tensors of shape ``[..., n]`` whose leading dims are rows encoded
independently (one per destination or source rank), and dispatches on the device: CUDA tensors
run the Triton kernels in ``fsdp_qcomm.kernels``, everything else the torch implementation in
``torch_codec``, whose hot loops run fused in C (``cpu_native``) where a C compiler is
available. All write the same bytes.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence, Union

import torch

from ..config import QuantSpec
from . import cpu_native, torch_codec
from ._checks import (
    BITS_DTYPE,
    FLOAT_DTYPES,
    chunk_rows,
    float_rows,
    out_rows,
    raw_memory_ok,
    require_key,
    wire_rows,
)
from .rng import RngKey
from .wire import bits_per_element, hadamard_len, wire_bytes

Chunks = Union[torch.Tensor, Sequence[torch.Tensor]]


def _impl(t: torch.Tensor, *others: Optional[torch.Tensor]):
    """The implementation for these tensors (used by ``levels`` too): Triton on CUDA, else the C
    loops, which fall back to ``torch_codec`` themselves. Native code gets only tensors whose
    memory it may take (``raw_memory_ok``); any other tensor (a subclass, a view beyond its
    storage) takes ``torch_codec``, which dispatches through it."""
    if t.is_cuda:
        if not raw_memory_ok("cuda", t, *others):
            return torch_codec
        from .. import kernels  # imported lazily: triton is only needed on GPUs

        return kernels
    return cpu_native


def _check_wire(data: torch.Tensor, n: int, spec: QuantSpec, what: str) -> torch.Tensor:
    return wire_rows(data, wire_bytes(n, spec), what, lambda: f"{n} values under {spec}")


def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    key: Optional[RngKey] = None,
    *,
    ref: Optional[torch.Tensor] = None,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
    order: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Encode rows of ``x`` (or ``x - ref``; or ``H32 x`` padded to whole 32-blocks).

    Returns uint8 of shape ``x.shape[:-1] + (wire_bytes(m, spec),)`` with ``m = n`` or
    ``hadamard_len(n)``, or writes it into ``out`` of that shape (a slice of a larger wire
    buffer: the kernels and the C loop write there directly, saving a copy and a launch per
    call). ``key`` is required for stochastic rounding.

    ``order`` (host ints indexing the rows of a 2-D ``x``) returns the wire rows in that order,
    ``[len(order), W]``: the bytes of ``quantize(x, ...)[order]``. The kernels read the rows in
    that order, with no wire buffer in input order and no gather out of it.
    """
    require_key(spec, key)
    rows = float_rows(x, "x")
    r = None
    if ref is not None:
        if ref.shape != x.shape:
            raise ValueError(f"ref shape {tuple(ref.shape)} must equal x shape {tuple(x.shape)}")
        r = float_rows(ref, "ref")
    if order is not None:
        return _quantize_ordered(x, rows, r, spec, key, hadamard, out, order)
    o = None
    if out is not None:
        m = hadamard_len(x.shape[-1]) if hadamard else x.shape[-1]
        if out.shape[:-1] != x.shape[:-1]:
            raise ValueError(f"out shape {tuple(out.shape)} must be x's leading shape "
                             f"{tuple(x.shape[:-1])} plus the wire row")
        wire_rows(out, wire_bytes(m, spec), "out", lambda: f"{m} values under {spec}")
        try:
            o = out.view(-1, out.shape[-1])
        except RuntimeError as e:
            raise ValueError(f"out (shape {tuple(out.shape)}, stride {out.stride()}) must be "
                             "viewable as [rows, wire bytes]: a slice of a contiguous "
                             "buffer, for example") from e
    res = _impl(rows, r, o).quantize(rows, spec, key, r, hadamard, o)
    return out if out is not None else res.view(*x.shape[:-1], res.shape[-1])


def _quantize_ordered(x, rows, r, spec, key, hadamard, out, order) -> torch.Tensor:
    if out is not None:
        raise ValueError("quantize: order= returns a new tensor; out= cannot be given with it")
    if x.dim() != 2:
        raise ValueError(f"quantize: order= indexes the rows of a 2-D x, got shape "
                         f"{tuple(x.shape)}")
    order = _checked_order(tuple(order), x.shape[0])
    impl = _impl(rows, r)
    fused = getattr(impl, "quantize_ordered", None)
    if fused is not None:
        return fused(rows, spec, key, r, hadamard, order)
    res = impl.quantize(rows, spec, key, r, hadamard, None)
    return _rows_in_order(res, order)


@functools.lru_cache(maxsize=256)
def _checked_order(order: tuple, rows: int) -> tuple:
    if not all(isinstance(i, int) and 0 <= i < rows for i in order):
        raise ValueError(f"quantize: order must be ints in [0, {rows}) (rows of x), got "
                         f"{list(order)}")
    return order


@functools.lru_cache(maxsize=256)
def _order_index(order: tuple, device: torch.device) -> torch.Tensor:
    """``order`` as an index tensor on ``device``, built once per order and device."""
    return torch.tensor(order, dtype=torch.long, device=device)


def _rows_in_order(rows: torch.Tensor, order: tuple) -> torch.Tensor:
    """``rows[order]`` through the cached index. On a GPU the index is marked as read by the
    current stream: evicted from the cache, its memory would otherwise go back to the stream it
    was made on while this stream's gather may still be queued."""
    index = _order_index(order, rows.device)
    if index.is_cuda:
        index.record_stream(torch.cuda.current_stream(index.device))
    return rows.index_select(0, index)


def quantize_segments(
    x: torch.Tensor,
    segments: Sequence[int],
    spec: QuantSpec,
    key: Optional[RngKey] = None,
    *,
    key_salt: int = 0,
    ref: Optional[torch.Tensor] = None,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Encode a flat ``x`` (or ``x - ref``) made of back-to-back segments of ``segments[k]``
    values, each as its own wire row, as ``quantize`` of that segment alone with the key
    ``key.fold(key_salt + k)``; the rows back to back in a flat uint8 tensor (or in ``out``).
    One kernel launch on CUDA, where a launch per segment would cost the host more than the
    GPU; elsewhere a ``quantize`` per segment (``dequantize_segments`` decodes it)."""
    require_key(spec, key)
    for t, what in ((x, "x"), (ref, "ref")):
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{what} must be float32/bfloat16/float16, got {t.dtype}")
    if x.dim() != 1:
        raise ValueError(f"x must be flat (1-D), got shape {tuple(x.shape)}")
    segs = tuple(int(n) for n in segments)
    if any(n < 0 for n in segs) or sum(segs) != x.numel():
        raise ValueError(f"segments {list(segs)} must be >= 0 and sum to x's {x.numel()} values")
    if ref is not None and ref.shape != x.shape:
        raise ValueError(f"ref shape {tuple(ref.shape)} must equal x shape {tuple(x.shape)}")
    total = sum(_widths(segs, spec, hadamard))
    if out is not None:
        wire_rows(out, total, "out", lambda: f"segments of {list(segs)} values under {spec}")
        if out.dim() != 1:
            raise ValueError(f"out must be flat (1-D), got shape {tuple(out.shape)}")
    impl = _impl(x, ref, out)
    fused = getattr(impl, "quantize_segments", None)
    if fused is not None and all(t is None or t.is_contiguous() for t in (x, ref, out)):
        return fused(x, segs, spec, key, key_salt, ref, hadamard, out)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=x.device)
    return _each_quantize(impl, x, segs, spec, key, key_salt, ref, hadamard, out)


def _widths(segments: Sequence[int], spec: QuantSpec, hadamard: bool) -> tuple[int, ...]:
    """Wire bytes of each segment's row (rotated rows pad to whole 32-blocks)."""
    return _widths_of(tuple(segments), spec, hadamard)


@functools.lru_cache(maxsize=1024)
def _widths_of(segments: tuple, spec: QuantSpec, hadamard: bool) -> tuple[int, ...]:
    # cached per layout: every qWD gather asks for its shard's widths two or three times
    return tuple(wire_bytes(hadamard_len(n) if hadamard else n, spec) for n in segments)


def _each_quantize(impl, x: torch.Tensor, segments: Sequence[int], spec: QuantSpec,
                   key: Optional[RngKey], key_salt: int, ref: Optional[torch.Tensor],
                   hadamard: bool, out: torch.Tensor) -> torch.Tensor:
    """``quantize_segments`` as a ``quantize`` of ``impl`` (an implementation module) per
    segment, on checked flat tensors."""
    off = woff = 0
    for k, (n, w) in enumerate(zip(segments, _widths(segments, spec, hadamard))):
        if n:
            impl.quantize(x[off:off + n].view(1, n), spec,
                          None if key is None else key.fold(key_salt + k),
                          None if ref is None else ref[off:off + n].view(1, n), hadamard,
                          out[woff:woff + w].view(1, w))
        off += n
        woff += w
    return out


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
    o = out_rows(out, rows.shape[0], n, accumulate)
    res = _impl(rows, o).dequantize(rows, n, spec, hadamard, o, accumulate)
    return out if out is not None else res.view(*data.shape[:-1], n)


def dequantize_segments(
    data: torch.Tensor,
    segments: Sequence[int],
    spec: QuantSpec,
    *,
    out: torch.Tensor,
    hadamard: bool = False,
    accumulate: bool = False,
    row_base: Optional[tuple[int, torch.Tensor]] = None,
) -> torch.Tensor:
    """Decode rows of back-to-back wire rows, one per segment of ``segments[k]`` values (each
    encoded on its own, as ``quantize`` of that segment), into the columns of ``out``
    ``[..., sum(segments)]`` (``accumulate`` adds). One kernel launch on CUDA, where a launch
    per segment would cost the host more than the GPU; elsewhere a ``dequantize`` per
    segment.

    ``row_base`` ``(r, base)``, with ``accumulate``: row ``r`` of the 2-D ``out`` adds its
    values to ``base`` (flat, ``sum(segments)`` values of ``out``'s dtype and device) instead
    of to what ``out[r]`` holds, and ``out[r]`` and ``base`` both take the sums. qWD keeps the
    reference of its own shard beside the gather buffer, whose own slot FSDP overwrites with
    the new weights: this adds to it and updates it in the same pass (on CUDA; elsewhere by
    copies, the same values)."""
    segs = tuple(int(n) for n in segments)
    if any(n < 0 for n in segs):
        raise ValueError(f"segment lengths must be >= 0, got {list(segs)}")
    widths = _widths(segs, spec, hadamard)
    if sum(segs) == 0:  # a rank with nothing: no [R, 0] view to take
        if data.dtype != torch.uint8 or data.shape[-1] != 0:
            raise ValueError(f"data must be empty uint8 rows for segments {list(segs)}, got "
                             f"{data.dtype} {tuple(data.shape)}")
        return out
    rows = wire_rows(data, sum(widths), "data",
                     lambda: f"segments of {list(segs)} values under {spec}")
    o = out_rows(out, rows.shape[0], sum(segs), accumulate)
    if row_base is not None:
        _check_row_base(row_base, out, o, accumulate)
    impl = _impl(rows, o, None if row_base is None else row_base[1])
    fused = getattr(impl, "dequantize_segments", None)
    if fused is not None:
        fused(rows, segs, spec, hadamard, o, accumulate, row_base)
    else:
        _through_row_base(o, row_base,
                          lambda: _each_segment(impl, rows, segs, spec, hadamard, o, accumulate))
    return out


def _through_row_base(out: torch.Tensor, row_base: Optional[tuple[int, torch.Tensor]],
                      decode: Callable[[], object]) -> None:
    """``decode()``, a decode that adds into the 2-D ``out``, with ``row_base`` ``(r, base)``
    as ``dequantize_segments`` takes it, by copies: ``base`` into ``out[r]`` before, the sums
    back into ``base`` after (what a kernel does in its pass)."""
    if row_base is not None:
        out[row_base[0]].copy_(row_base[1])
    decode()
    if row_base is not None:
        row_base[1].copy_(out[row_base[0]])


def _check_row_base(row_base: tuple[int, torch.Tensor], out: torch.Tensor, o: torch.Tensor,
                    accumulate: bool) -> None:
    r, base = row_base
    if not accumulate or out.dim() != 2:
        raise ValueError("row_base= needs accumulate=True and a 2-D out (one row per wire row)")
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < o.shape[0]:
        raise ValueError(f"row_base's row must be an int in [0, {o.shape[0]}), got {r!r}")
    if base.shape != (o.shape[1],) or base.dtype != o.dtype or base.device != o.device:
        raise ValueError(f"row_base's tensor must be flat [{o.shape[1]}] {o.dtype} on {o.device}"
                         f" (a row of out); got {tuple(base.shape)} {base.dtype} on {base.device}")


def _each_segment(impl, rows: torch.Tensor, segments: Sequence[int], spec: QuantSpec,
                 hadamard: bool, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """``dequantize_segments`` as a ``dequantize`` of ``impl`` (an implementation module) per
    segment, on checked ``[R, W]`` rows and ``[R, sum(segments)]`` output."""
    off = woff = 0
    for n, w in zip(segments, _widths(segments, spec, hadamard)):
        if n:
            impl.dequantize(rows[:, woff:woff + w], n, spec, hadamard, out[:, off:off + n],
                            accumulate)
        off += n
        woff += w
    return out


def _chunk_rows(chunks: Chunks, n: int, spec: QuantSpec
                ) -> tuple[list[torch.Tensor], tuple, torch.Size]:
    return chunk_rows(chunks, wire_bytes(n, spec), lambda: f"{n} values under {spec}")


def reduce_requantize(
    chunks: Chunks, n: int, spec_in: QuantSpec, spec_out: QuantSpec, key: Optional[RngKey] = None
) -> torch.Tensor:
    """Decode k wire blocks, sum them in fp32 (in order), re-encode with ``spec_out``.

    ``n`` is the row length as encoded (already ``hadamard_len``-padded where Hadamard is used);
    the Hadamard rotation is kept, since sums commute with it.
    """
    seq, held, shape = _chunk_rows(chunks, n, spec_in)
    require_key(spec_out, key)
    out = _impl(*held).reduce_requantize(seq, n, spec_in, spec_out, key)
    return out.view(*shape, out.shape[-1])


def reduce_dequantize(
    chunks: Chunks,
    n: int,
    spec: QuantSpec,
    *,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
    divide: Optional[float] = None,
) -> torch.Tensor:
    """Decode k wire blocks, sum in fp32 (in order), undo the Hadamard once, keep ``n`` values;
    with ``divide`` (a positive finite number), each value divided by it in fp32 before it is
    written: a reduce-scatter's AVG in the same pass (the sum's IEEE quotient, as
    ``sum.div_(divide)`` gives it)."""
    if divide is not None and not (isinstance(divide, (int, float)) and not isinstance(divide, bool)
                                   and 0 < divide < math.inf):
        raise ValueError(f"divide must be a positive finite number (a group size), got {divide!r}")
    m = hadamard_len(n) if hadamard else n
    seq, held, shape = _chunk_rows(chunks, m, spec)
    o = out_rows(out, seq[0].shape[0], n)
    res = _impl(*held, o).reduce_dequantize(seq, n, spec, hadamard, o,
                                            None if divide is None else float(divide))
    return out if out is not None else res.view(*shape, n)


__all__ = [
    "BITS_DTYPE",
    "FLOAT_DTYPES",
    "RngKey",
    "bits_per_element",
    "dequantize",
    "dequantize_segments",
    "hadamard_len",
    "quantize",
    "quantize_segments",
    "reduce_dequantize",
    "reduce_requantize",
    "wire_bytes",
]
