"""Audits Triton launches under the interpreter for what only a GPU would get wrong.

The interpreter runs a launch's programs one after another, and each operation over all of a
program's lanes at once, so a kernel whose programs or threads race still yields the right bytes
there: the last write wins, a read sees a neighbour's finished output, and a stray address is
host memory. ``install()`` records every load and store of each launch and, at its end, raises
``KernelHazard`` if

* one byte was written with two different values: by two programs (they run in no fixed
  order), or by two lanes or two stores of one program (on a GPU the lanes are threads, and
  threads order their global writes only across a barrier, which Triton does not put between
  two stores);
* a byte one program wrote was read by another program;
* a store reached outside the elements of every tensor argument (a kernel given a slice of a
  buffer writes that slice only), or a load outside their storages (a read elsewhere in a
  buffer's allocation is harmless, which the reduce kernels rely on: they read the chunks that
  follow their first chunk's view);
* a program read a byte after writing it: the compiler chooses which thread holds which
  lane, so the writer may be another thread, and Triton orders global memory between threads
  only across a barrier.

Bytes written twice with one value are not hazards (a replicated layout does that). Atomics
are not recorded (their order does not change a sum).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import numpy as np

_HERE = str(Path(__file__).resolve())


class KernelHazard(AssertionError):
    """A launch whose result on a GPU would depend on the order of its programs or threads,
    or that touched memory outside its tensors."""


class _Access:
    """One load or store of one program: its byte addresses (and, for a store, the bytes it
    wrote), its place in the launch's order of accesses, and its source line."""

    __slots__ = ("program", "seq", "addr", "vals", "site")

    def __init__(self, program: int, seq: int, addr: np.ndarray, vals, site: str):
        self.program, self.seq, self.addr, self.vals, self.site = program, seq, addr, vals, site


class _Launch:
    def __init__(self, name: str):
        self.name = name
        # [start, end) byte ranges a store may reach (views) and a load (their storages)
        self.views: list[tuple[int, int]] = []
        self.storages: list[tuple[int, int]] = []
        self.stores: list[_Access] = []
        self.loads: list[_Access] = []
        self.seq = 0

    def add(self, args) -> None:
        """Record the tensors among ``args`` (nested in tuples and lists)."""
        for a in args:
            if isinstance(a, (tuple, list)):
                self.add(a)
            elif hasattr(a, "untyped_storage"):
                self.views.append(_extent(a))
                s = a.untyped_storage()
                self.storages.append((s.data_ptr(), s.data_ptr() + s.nbytes()))

    def access(self, program: int, addr: np.ndarray, vals=None) -> None:
        self.seq += 1
        (self.loads if vals is None else self.stores).append(
            _Access(program, self.seq, addr, vals, _site()))


_current: list[_Launch] = []
_reachable: list = []


@contextlib.contextmanager
def reachable(tensors):
    """Tensors the launches inside reach through a table of their addresses rather than as
    arguments (the digest's shards): their elements count as every launch's own."""
    start = len(_reachable)
    _reachable.extend(tensors)
    try:
        yield
    finally:
        del _reachable[start:]


def _extent(t) -> tuple[int, int]:
    """The bytes [start, end) a tensor's elements span: its view, not its whole storage, so a
    kernel given a slice of a buffer may not touch the rest."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
    first = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st < 0)
    return t.data_ptr() + first * t.element_size(), t.data_ptr() + (last + 1) * t.element_size()


def _program(builder) -> int:
    x, y, z = builder.grid_idx
    gx, gy, _ = builder.grid_dim
    return x + gx * (y + gy * z)


@functools.cache
def _triton_dir() -> str:
    import triton

    return str(Path(triton.__file__).resolve().parent)


def _site() -> str:
    """The kernel source line of the load or store being recorded (first frame outside
    triton and this file)."""
    tri = _triton_dir()
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(tri)
                             or f.f_code.co_filename == _HERE):
        f = f.f_back
    return f"{Path(f.f_code.co_filename).name}:{f.f_lineno}" if f is not None else "?"


def _bytes(ptrs: np.ndarray, mask: np.ndarray, size: int) -> np.ndarray:
    """Byte addresses [k * size] of the masked-in lanes."""
    p, m = np.broadcast_arrays(ptrs, mask)
    addr = p.ravel()[m.ravel().astype(bool)].astype(np.uint64)
    return (addr[:, None] + np.arange(size, dtype=np.uint64)[None, :]).ravel()


def install() -> None:
    """Patch the interpreter of this process (once) to audit every launch."""
    from triton.runtime import interpreter as I

    if getattr(I.GridExecutor, "_fsdp_qcomm_audit", False):
        return
    builder = I.interpreter_builder
    call, init_args = I.GridExecutor.__call__, I.GridExecutor._init_args_hst
    store, load = I.InterpreterBuilder.create_masked_store, I.InterpreterBuilder.create_masked_load

    def audited_call(self, *args, **kwargs):
        _current.append(_Launch(getattr(self.fn, "__name__", "kernel")))
        _current[-1].add(_reachable)
        try:
            out = call(self, *args, **kwargs)
            check(_current[-1])
            return out
        finally:
            _current.pop()

    def recorded_args(self, *args, **kwargs):
        hst = init_args(self, *args, **kwargs)
        if _current:
            _current[-1].add([*hst[0], *hst[1].values()])
        return hst

    def recorded_store(self, ptrs, value, mask, *rest):
        if _current:
            v = np.ascontiguousarray(np.broadcast_to(value.data, ptrs.data.shape))
            _, m = np.broadcast_arrays(ptrs.data, mask.data)
            vals = v.ravel()[m.ravel().astype(bool)].view(np.uint8)
            _current[-1].access(_program(builder), _bytes(ptrs.data, mask.data,
                                                          v.dtype.itemsize), vals)
        return store(self, ptrs, value, mask, *rest)

    def recorded_load(self, ptrs, mask, other, *rest):
        if _current:
            size = I._get_np_dtype(ptrs.get_element_ty()).itemsize
            _current[-1].access(_program(builder), _bytes(ptrs.data, mask.data, size))
        return load(self, ptrs, mask, other, *rest)

    I.GridExecutor.__call__ = audited_call
    I.GridExecutor._init_args_hst = recorded_args
    I.InterpreterBuilder.create_masked_store = recorded_store
    I.InterpreterBuilder.create_masked_load = recorded_load
    I.GridExecutor._fsdp_qcomm_audit = True


def _flat(recs: list[_Access]) -> dict[str, np.ndarray]:
    """The accesses' per-byte columns: address, program, access index, order (and value)."""
    col = {"addr": np.zeros(0, np.uint64), "prog": np.zeros(0, np.int64),
           "rec": np.zeros(0, np.int64), "seq": np.zeros(0, np.int64),
           "val": np.zeros(0, np.uint8)}
    if recs:
        n = [len(r.addr) for r in recs]
        col["addr"] = np.concatenate([r.addr for r in recs])
        col["prog"] = np.repeat([r.program for r in recs], n)
        col["rec"] = np.repeat(np.arange(len(recs)), n)
        col["seq"] = np.repeat([r.seq for r in recs], n)
        if recs[0].vals is not None:
            col["val"] = np.concatenate([r.vals for r in recs])
    return col


def _outside(addr: np.ndarray, ranges: list) -> np.ndarray:
    """Which byte addresses lie in none of the [start, end) ranges (which may overlap)."""
    if not ranges:
        return np.ones(len(addr), bool)
    lo, hi = (np.array(v, dtype=np.uint64) for v in zip(*sorted(ranges)))
    k = np.searchsorted(lo, addr, side="right") - 1
    reach = np.maximum.accumulate(hi)  # the furthest end among the ranges starting at or before
    return (k < 0) | (addr >= reach[np.maximum(k, 0)])


def check(launch: _Launch) -> None:
    """Raise ``KernelHazard`` naming the first hazard of each kind in one launch."""
    problems = []
    st, ld = _flat(launch.stores), _flat(launch.loads)

    for kind, col, recs, ranges in (("store", st, launch.stores, launch.views),
                                    ("load", ld, launch.loads, launch.storages)):
        bad = _outside(col["addr"], ranges)
        if bad.any():
            r = recs[col["rec"][int(np.argmax(bad))]]
            problems.append(f"{kind} outside every tensor argument: {int(bad.sum())} bytes, "
                            f"first by program {r.program} at {r.site}")
    if len(st["addr"]):
        order = np.lexsort((st["val"], st["addr"]))
        a, v = st["addr"][order], st["val"][order]
        two = (a[1:] == a[:-1]) & (v[1:] != v[:-1])
        if two.any():
            j = int(np.argmax(two))
            sites = sorted({(int(st["prog"][i]), launch.stores[st["rec"][i]].site)
                            for i in order[j:j + 2]})
            problems.append(
                f"{int(two.sum())} bytes written with different values (first byte by "
                f"program, store: {sites}): a race between programs or threads")
    if len(st["addr"]) and len(ld["addr"]):
        # per written byte: its writers' lowest and highest program and its first store
        order = np.argsort(st["addr"], kind="stable")
        a = st["addr"][order]
        ua, first = np.unique(a, return_index=True)
        pmin = np.minimum.reduceat(st["prog"][order], first)
        pmax = np.maximum.reduceat(st["prog"][order], first)
        smin = np.minimum.reduceat(st["seq"][order], first)
        k = np.minimum(np.searchsorted(ua, ld["addr"]), len(ua) - 1)
        hit = ua[k] == ld["addr"]
        other = hit & ((pmin[k] != ld["prog"]) | (pmax[k] != ld["prog"]))
        own = hit & ~other & (smin[k] < ld["seq"])
        for mask, what in (
                (other, "read by a program that did not write them: programs run in no fixed "
                        "order"),
                (own, "read after the same program wrote them: the writer may be another of "
                      "its threads, and no barrier orders global memory")):
            if mask.any():
                j = int(np.argmax(mask))
                problems.append(
                    f"{int(mask.sum())} bytes {what} (first: program {int(ld['prog'][j])} at "
                    f"{launch.loads[ld['rec'][j]].site}, written by program {int(pmin[k[j]])})")
    if problems:
        raise KernelHazard(f"{launch.name}: " + "; ".join(problems))
