"""Learned (non-uniform) quantization levels: QSDP's optional level sets, and their wire rows.

A level table ``L`` holds ``2^b`` sorted fp32 levels in a normalized space: ``[0, 1]`` for
min-max specs (``t = (x - min) / (max - min)``) and ``[-1, 1]`` for symmetric specs
(``t = x / absmax``). ``L[0]`` and ``L[-1]`` are the domain bounds, so every group's extremes
stay exact, and the interior levels sit where the values are dense. A value between levels
``L[k] <= t < L[k+1]`` is sent as ``k + 1`` with probability ``(t - L[k]) / (L[k+1] - L[k])``
and as ``k`` otherwise (stochastic rounding; compared without a division per element,
``wire.py``), so ``E[decode] = x``: learned levels stay unbiased. ``rounding="nearest"``
picks the nearer level instead.

Wire row (an extension of ``wire.py``'s row: same scale, min and code sections)::

    [ levels : 2^b x float32 ]                  the table this row was encoded with
    [ scales : G x scale_dtype ]                per group: max - min (min-max) or absmax
    [ mins   : G x scale_dtype ]                min-max specs only
    [ codes  : ceil(n / 8) * b bytes ]          level indices 0 .. 2^b-1, packed as in wire.py
    [ zero padding to a multiple of 4 bytes ]

Decoding: ``x = min + scale * L[u]`` (min-max) or ``x = scale * L[u]`` (symmetric). Unlike the
uniform format the scale is the group's whole range, not range / qmax; a zero range is stored
as 0, so a constant group decodes exactly. Non-finite groups get the NaN scale of ``wire.py``.
The table travels with every row, so a receiver needs no state to decode (a row is
self-describing) and a table mismatch between ranks cannot corrupt a transfer; the cost is
``4 * 2^b`` bytes per row (64 bytes at 4 bits, 1 KiB at 8 bits), counted by
``levels_wire_bytes``. ``collectives.level_sync`` keeps the tables identical on all ranks.

Fitting (``fit_levels``) works on a histogram of normalized values (``histogram``: fp64,
each value weighted by its group's squared scale so the fit minimizes the error in value
space). For stochastic rounding it minimizes the expected squared error
``sum_t c_t (t - L[k]) (L[k+1] - t)`` exactly by coordinate descent (each level's objective
is convex and piecewise linear between bin centres, so its minimum is a bin centre found from
prefix sums); QSDP reaches the same objective by gradient steps. For nearest rounding it runs
Lloyd-Max (levels = centroids, boundaries = midpoints). Both start from the
``p^(1/3)`` companding quantiles, the high-resolution optimum, and run in fp64 numpy on the
CPU. The result is mixed 1% with the uniform table so levels are strictly increasing.

Implementations: like the uniform codec, CUDA tensors run Triton kernels
(``fsdp_qcomm.kernels.levels``), CPU tensors the fused C loops (``cpu_native``) where a compiler
exists, else the torch reference (``torch_codec.quantize_levels``); all three write the same
bytes (``tests/test_codec_native.py``, ``tests/test_kernels.py``). Encoding and decoding never
synchronize with the host: a table is validated (a host read) once per tensor version, not per
call.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from ..config import QuantSpec
from . import _impl, torch_codec
from ._checks import chunk_rows, float_rows, out_rows, require_key, wire_rows
from .rng import RngKey
from .wire import LEVELS_DTYPE, levels_wire_bytes, num_levels, table_bytes
from .wire import levels_domain as domain

DEFAULT_BINS = 4096
_FIT_ITERS = 40
_UNIFORM_MIX = 0.01


def uniform_levels(spec: QuantSpec, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """Evenly spaced levels over the domain (what the learned table starts from)."""
    lo, hi = domain(spec)
    return torch.linspace(lo, hi, num_levels(spec), dtype=torch.float64).to(LEVELS_DTYPE).to(device)


# Tables already validated, by id: (weak reference, version counter, spec bits and domain). A
# table is checked once per in-place change, so encoding on a CUDA table reads nothing back to
# the host on later calls (the check itself needs the values on the host).
_CHECKED: dict[int, tuple[weakref.ref, int, tuple]] = {}


def check_levels(levels: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Validate a table: 2^b fp32 values, strictly increasing, ends at the domain bounds.

    The value check reads the table on the host once per table and in-place change (cached by
    identity and version counter); shape and dtype are checked every call."""
    k = num_levels(spec)
    if levels.dtype != LEVELS_DTYPE or levels.shape != (k,):
        raise ValueError(
            f"a level table for {spec.bits}-bit codes is float32 of shape ({k},), got "
            f"{levels.dtype} {tuple(levels.shape)}; build one with uniform_levels or fit_levels"
        )
    lo, hi = domain(spec)
    tag = (k, lo, hi)
    hit = _CHECKED.get(id(levels))
    if hit is not None and hit[0]() is levels and hit[1] == levels._version and hit[2] == tag:
        return levels
    lv = levels.detach().to("cpu")
    if not bool((lv[1:] > lv[:-1]).all()) or lv[0].item() != lo or lv[-1].item() != hi:
        raise ValueError(
            f"level table must increase strictly from {lo} to {hi} "
            f"({'symmetric' if spec.symmetric else 'min-max'} spec), got {lv.tolist()}"
        )
    if len(_CHECKED) > 4096:  # drop entries of tables that are gone
        for key in [i for i, (ref, _, _) in _CHECKED.items() if ref() is None]:
            del _CHECKED[key]
    _CHECKED[id(levels)] = (weakref.ref(levels), levels._version, tag)
    return levels


# ---- group statistics ------------------------------------------------------------------------
def histogram(x: torch.Tensor, spec: QuantSpec, bins: int = DEFAULT_BINS) -> torch.Tensor:
    """fp64 histogram of the normalized values ``t`` of rows ``x[..., n]`` over ``bins`` equal
    bins of the domain, each value weighted by its group's ``scale^2`` (padding lanes and
    non-finite groups excluded). The weight makes the fit minimize the squared error of the
    values themselves: an error ``e`` in ``t`` is ``scale * e`` in ``x``, and with heavy tails
    the few wide groups dominate that error (unweighted counts fit the narrow groups and lose
    to uniform levels on Student-t data). Histograms of several ranks add up."""
    if bins < 2:
        raise ValueError(f"bins must be >= 2, got {bins}")
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    n = rows.shape[1]
    if n == 0 or rows.shape[0] == 0:
        return torch.zeros(bins, dtype=torch.float64)
    t, scale, _, bad = torch_codec.level_groups(rows, spec)
    valid = (torch.arange(t.shape[1] * t.shape[2], device=t.device) < n).view(1, *t.shape[1:])
    valid = valid & ~bad[..., None]
    lo, hi = domain(spec)
    idx = ((t - lo) * (bins / (hi - lo))).floor().clamp_(0, bins - 1).to(torch.int64)
    w = (scale.to(torch.float64) ** 2)[..., None].expand(t.shape)
    sel = valid.expand_as(idx)
    return torch.bincount(idx[sel], weights=w[sel], minlength=bins).to("cpu", torch.float64)


# ---- fitting ---------------------------------------------------------------------------------
def _compand_init(c: np.ndarray, centers: np.ndarray, k: int, lo: float, hi: float) -> np.ndarray:
    """Levels at the quantiles of density^(1/3) (high-resolution optimum)."""
    w = np.cbrt(c) + 1e-12
    cdf = np.concatenate(([0.0], np.cumsum(w)))
    cdf /= cdf[-1]
    edges = np.linspace(lo, hi, len(c) + 1)
    q = np.linspace(0.0, 1.0, k)
    return np.interp(q, cdf, edges)


def _fit_stochastic(c: np.ndarray, t: np.ndarray, L: np.ndarray) -> np.ndarray:
    """Coordinate descent on sum c (t - L[k]) (L[k+1] - t); odd levels, then even ones.

    With ``a, b`` a level's neighbours, its objective's slope just right of bin centre ``e`` is
    ``D(e) = sum_{a<t<=t_e} c (t - a) - sum_{t_e<t<b} c (b - t)``, nondecreasing in ``e``: the
    minimum is at the first centre with ``D >= 0``, found by a binary search on prefix sums.
    """
    k = len(L)
    pc = np.concatenate(([0.0], np.cumsum(c)))
    ps = np.concatenate(([0.0], np.cumsum(c * t)))
    steps = int(np.ceil(np.log2(len(t)))) + 1
    for _ in range(_FIT_ITERS):
        for start in (1, 2):  # odd levels given even neighbours, then even given odd
            idx = np.arange(start, k - 1, 2)
            if len(idx) == 0:
                continue
            a, b = L[idx - 1], L[idx + 1]
            ia = np.searchsorted(t, a, side="right")
            ib = np.searchsorted(t, b, side="left")  # bins strictly inside: [ia, ib)
            mass = np.where(ib > ia, pc[np.maximum(ib, ia)] - pc[ia], 0.0)

            def slope(e):
                left = (ps[e + 1] - ps[ia]) - a * (pc[e + 1] - pc[ia])
                right = b * (pc[ib] - pc[e + 1]) - (ps[ib] - ps[e + 1])
                return left - right

            lo, hi = ia.copy(), np.maximum(ib - 1, ia)
            for _ in range(steps):
                mid = (lo + hi) // 2
                ok = slope(np.minimum(mid, len(t) - 1)) >= 0
                hi = np.where(ok, mid, hi)
                lo = np.where(ok, lo, np.minimum(mid + 1, hi))
            L[idx] = np.where(mass > 0, t[np.minimum(hi, len(t) - 1)], (a + b) / 2)
    return L


def _fit_nearest(c: np.ndarray, t: np.ndarray, L: np.ndarray) -> np.ndarray:
    cs = np.concatenate(([0.0], np.cumsum(c)))
    ts = np.concatenate(([0.0], np.cumsum(c * t)))
    for _ in range(_FIT_ITERS * 2):
        bounds = (L[:-1] + L[1:]) / 2
        pos = np.searchsorted(t, bounds)  # bins left of boundary j: [.., pos[j])
        lo_i, hi_i = pos[:-1], pos[1:]  # level j (1..k-2) owns bins [pos[j-1], pos[j])
        m = cs[hi_i] - cs[lo_i]
        s = ts[hi_i] - ts[lo_i]
        interior = np.where(m > 0, s / np.where(m > 0, m, 1.0), L[1:-1])
        L[1:-1] = interior
    return L


def fit_levels(counts: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The level table minimizing the expected squared error of ``spec``'s rounding over a
    ``histogram``. Deterministic: the same counts give the same bits."""
    c = counts.detach().to("cpu", torch.float64).numpy()
    if c.ndim != 1 or len(c) < 2:
        raise ValueError("counts must be a 1-D histogram with at least 2 bins (see histogram())")
    lo, hi = domain(spec)
    k = num_levels(spec)
    if c.sum() <= 0:
        return uniform_levels(spec)
    centers = lo + (np.arange(len(c)) + 0.5) * ((hi - lo) / len(c))
    L = _compand_init(c, centers, k, lo, hi)
    L = (_fit_stochastic if spec.stochastic else _fit_nearest)(c, centers, L)
    L = np.sort(L)
    L = (1 - _UNIFORM_MIX) * L + _UNIFORM_MIX * np.linspace(lo, hi, k)
    L[0], L[-1] = lo, hi
    return torch.from_numpy(L).to(LEVELS_DTYPE)


# ---- encode / decode -------------------------------------------------------------------------
def _layout(n: int, spec: QuantSpec) -> Callable[[], str]:
    return lambda: f"{n} values with learned levels under {spec}"


def _wire_rows(data: torch.Tensor, n: int, spec: QuantSpec, what: str) -> torch.Tensor:
    return wire_rows(data, levels_wire_bytes(n, spec), what, _layout(n, spec))


def quantize_levels(
    x: torch.Tensor, spec: QuantSpec, levels: torch.Tensor, key: Optional[RngKey] = None
) -> torch.Tensor:
    """Encode rows of ``x[..., n]`` on the level table ``levels``; uint8 ``[..., W]`` with
    ``W = levels_wire_bytes(n, spec)``. ``key`` is required for stochastic rounding."""
    require_key(spec, key)
    check_levels(levels, spec)
    rows = float_rows(x, "x")
    out = _impl(rows).quantize_levels(rows, spec, levels, key)
    return out.view(*x.shape[:-1], out.shape[-1])


def dequantize_levels(
    data: torch.Tensor,
    n: int,
    spec: QuantSpec,
    *,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Decode learned-levels rows into ``[..., n]`` fp32 (or into ``out``; ``accumulate`` adds)."""
    rows = _wire_rows(data, n, spec, "data")
    o = out_rows(out, rows.shape[0], n, accumulate)
    res = _impl(rows, o).dequantize_levels_sum([rows], n, spec, o, accumulate)
    return out if out is not None else res.view(*data.shape[:-1], n)


def reduce_dequantize_levels(
    chunks: Union[torch.Tensor, Sequence[torch.Tensor]],
    n: int,
    spec: QuantSpec,
) -> torch.Tensor:
    """Decode k learned-levels blocks and sum them in fp32, in order 0..k-1."""
    seq, held, shape = chunk_rows(chunks, levels_wire_bytes(n, spec), _layout(n, spec))
    res = _impl(*held).dequantize_levels_sum(seq, n, spec)
    return res.view(*shape, n)


__all__ = [
    "DEFAULT_BINS",
    "LEVELS_DTYPE",
    "check_levels",
    "dequantize_levels",
    "domain",
    "fit_levels",
    "histogram",
    "levels_wire_bytes",
    "num_levels",
    "quantize_levels",
    "reduce_dequantize_levels",
    "table_bytes",
    "uniform_levels",
]
