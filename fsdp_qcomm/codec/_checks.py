"""Argument checks and dtype tables shared by the codec's entry points (uniform and learned
levels) and by the collectives above them."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from ..config import QuantSpec
from .rng import RngKey

#: Value dtypes the codec quantizes (and quantized collectives accept).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Same-width integer views of those dtypes: NaN scales are written as these bit patterns
#: (``wire.NAN_BITS``) because float casts of NaN differ between CPU paths and GPUs.
BITS_DTYPE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def float_rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """``x[..., n]`` as ``[rows, n]``, refusing non-float and 0-d inputs."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what} must be float32/bfloat16/float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension")
    return x.reshape(-1, x.shape[-1])


def wire_rows(data: torch.Tensor, expect: int, what: str,
              layout: Callable[[], str]) -> torch.Tensor:
    """``data[..., W]`` as ``[rows, W]`` after checking it is uint8 with ``W == expect``;
    ``layout()`` says what needs ``expect`` bytes, for the error message. It is called only to
    raise: a spec's repr in an f-string took most of a collective's checks' host time (about
    5 us a call, k calls per reduce)."""
    if data.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8 wire bytes, got {data.dtype}")
    if data.shape[-1] != expect:
        raise ValueError(f"{what} rows have {data.shape[-1]} bytes but {layout()} take {expect}")
    return data.reshape(-1, expect)


def require_key(spec: QuantSpec, key: Optional[RngKey]) -> None:
    if spec.stochastic and key is None:
        raise ValueError(
            f"{spec} rounds stochastically and needs key=RngKey(seed, step, rank, bucket)"
        )


def out_rows(
    out: Optional[torch.Tensor], rows: int, n: int, accumulate: bool = False
) -> Optional[torch.Tensor]:
    """``out`` viewed as ``[rows, n]`` (None stays None); ``accumulate`` needs an ``out``."""
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out= (the tensor to add into)")
        return None
    if out.numel() != rows * n or out.shape[-1] != n:
        raise ValueError(f"out shape {tuple(out.shape)} does not hold {rows} rows of {n}")
    return out.view(-1, n)


def chunk_rows(chunks: Union[torch.Tensor, Sequence[torch.Tensor]], expect: int,
               layout: Callable[[], str]) -> tuple[list[torch.Tensor], tuple, torch.Size]:
    """k received blocks (a ``[k, ...]`` tensor or a sequence) of one common shape, each as
    ``wire_rows``; with the tensors that hold them (for the dispatch's memory check) and a
    block's leading shape. A ``[k, ...]`` tensor is checked once, not block by block: per block,
    the checks took 66 us of host time for k=8 on the CI machine, on every reduce."""
    if isinstance(chunks, torch.Tensor) and chunks.dim() >= 2 and chunks.shape[0] > 0:
        rows = wire_rows(chunks, expect, "chunk", layout)
        return list(rows.view(chunks.shape[0], -1, expect).unbind(0)), (chunks,), \
            chunks.shape[1:-1]
    seq = list(chunks.unbind(0)) if isinstance(chunks, torch.Tensor) else list(chunks)
    if not seq:
        raise ValueError("need at least one chunk to reduce")
    shape = seq[0].shape
    for c in seq:
        if c.shape != shape:
            raise ValueError(
                f"all chunks must share one shape, got {tuple(shape)} and {tuple(c.shape)}"
            )
    rows = [wire_rows(c, expect, "chunk", layout) for c in seq]
    return rows, tuple(rows), shape[:-1]

def raw_memory_ok(device_type: str, *tensors: Optional[torch.Tensor]) -> bool:
    """Whether native code (the C loops, Triton kernels) may take these tensors' memory through
    ``data_ptr()`` (None entries are skipped): tensors of torch's own classes on
    ``device_type``, strided, whose storage holds every element they address. Not a tensor
    subclass (a wrapper's ``data_ptr()`` is not its data: torchao's float8 weights handed to C
    killed every rank, docs/assumptions.md), not a functional or fake tensor, not meta. Callers
    take the torch path otherwise, which dispatches through whatever the tensor is."""
    for t in tensors:
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided \
                or t.device.type != device_type or _is_functional(t):
            return False
        if t.numel() == 0:
            continue
        try:
            storage = t.untyped_storage()
            base, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            return False
        es = t.element_size()
        last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        if min(t.stride(), default=0) < 0 or t.data_ptr() != base + t.storage_offset() * es \
                or (last + 1) * es > size:
            return False
    return True


def _is_functional(t: torch.Tensor) -> bool:
    check = getattr(torch, "_is_functional_tensor", None)
    return bool(check is not None and check(t))
