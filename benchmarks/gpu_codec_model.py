"""What ``enable(preset)`` adds to a GPU training step, counted on the CPU and priced at the
bandwidths a GPU run measured.

``gpu_step_cost.py`` measures the codec's share of a bf16 step on a GPU (26-39% on the first
run's H200, 9.3-18.5% on the H100 of 2026-12-06, against a goal of 10%) but not which work
makes it up. This script counts that work without a GPU: it trains the same Llama-shaped
step (bf16 parameters, fp32 reduction, AdamW) as rank 0 of W ranks through torch's ``fake``
backend, once without and once with ``enable``, and records

* every codec call (what the Triton kernels run on CUDA): kernel, elements, the bytes it must
  read and write (as ``gpu_kernels_bench.py`` counts them);
* every other tensor operation, by the innermost fsdp_qcomm function it ran from ("glue":
  copies, casts, digests, buffer fills) or as FSDP2 / model / optimizer work, with the bytes it
  reads and writes (inputs plus outputs; views move nothing; copies and fills do not read
  their destination) and how many there are (each is a kernel launch on CUDA).

Each count is scaled from the counted model to the target shape by padded parameters (the
codec's work is linear in them; the layer count, hence the launch count, is the target's), and
priced: a codec call at the GB/s its kernel's row of the GPU bandwidth table measured, any other
operation at ``torch.clone``'s GB/s (a lower bound: small or strided operations run slower).
The sum is a floor on what the codec adds per step, to hold against the measured
``codec_ms``, with the launches it adds; what the floor leaves unexplained is launch and
Python overhead, idle GPU time or kernels slower than at the bandwidth bench's size, which
``gpu_check.sh``'s ``step_profile`` step measures. The CPU path's own choices are replaced by
the CUDA path's (``_as_on_cuda``).

It also times, on this CPU, the host time the hooks add per step with the codec's work taken
out (``host_ms``): their Python, dispatch and the glue's operations on small tensors. That is a
proxy, tracked from commit to commit, for what the hooks cost a GPU job's host.

    python benchmarks/gpu_codec_model.py [--target 1B] [--world 8:1] [--preset sdp4bit]
        [--gpu-check results/gpu_check/h100_2026-12-06/gpu_check.json] [--out DIR --label L]
        [--torch-digest] [--host-steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
import _provenance  # noqa: E402
from gpu_kernels_bench import AVG_ROW, BF16_ROWS  # noqa: E402
from gpu_step_cost import SHAPES, LlamaShape, build_step  # noqa: E402

#: the latest GPU run (the first, the H200's, is results/gpu_check/h200_2026-12-04)
DEFAULT_GPU_CHECK = ROOT / "results" / "gpu_check" / "h100_2026-12-06" / "gpu_check.json"


def counted_shape(target: LlamaShape) -> LlamaShape:
    """The model counted on the CPU: the target's layers (so its FSDP groups, hooks and
    launches) at 1/16 of its width, 1/256 of its weights, and a short sequence."""
    return LlamaShape(f"{target.name}/16", target.dim // 16, target.layers,
                      max(1, target.heads // 8), max(1, target.kv_heads // 8), target.ffn // 16,
                      target.vocab // 16, 64, 1)


#: a kernel the bandwidth table has no row for, priced at ``torch.clone``'s GB/s
CLONE_ROW = "torch.clone"
#: a grouped launch's row, where the table has one (else its one-row kernel's, ``_STAND_IN``)
_GROUPED = {"quantize 4b g2048 sym stoch x-ref (qWD)":
                "quantize_segments 4b g2048 x-ref (9 segments)",
            "dequantize 4b g2048 += fp32 (qWD)":
                "dequantize_segments 4b g2048 += fp32 (9 segments)"}
#: the encoder's row with its rows reordered (the gradient's first hop), where the table has one
_REORDERED = {"quantize 8b g128 sym stoch +H32":
              "quantize 8b g128 sym stoch +H32, rows reordered (gradient hop 1)"}
#: 2-bit learned levels (``lowbit``'s weights), a row since 2026-12-06
_LOWBIT_LEVELS = "quantize_levels 2b g2048 sym stoch (lowbit)"
#: the gradient's last hop with FSDP's AVG in the same pass, a row since 2026-12-06
_PLAIN_LAST_HOP = "reduce_dequantize k=4 4b g128 +H32^-1"
#: rows added to the bandwidth table after a GPU run, priced at the nearest row that run has
_STAND_IN = {"quantize 4b g128 sym stoch +H32": "quantize 8b g128 sym stoch +H32",
             _LOWBIT_LEVELS: "quantize_levels 4b g1024 asym stoch",
             AVG_ROW: _PLAIN_LAST_HOP,
             **{bf16: fp32 for fp32, bf16 in BF16_ROWS.items()},
             **{grouped: one_row for one_row, grouped in _GROUPED.items()},
             **{reordered: one_row for one_row, reordered in _REORDERED.items()}}
_PKG = (str(ROOT / "fsdp_qcomm"), str(ROOT / "kernels"))
_OTHER = "FSDP2, model, optimizer"
#: operations that allocate or alias without moving data
_FREE = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided",
         "aten.new_empty_strided", "aten.set_", "aten.resize_", "aten.detach", "aten.alias",
         "aten._local_scalar_dense", "aten.lift_fresh", "aten.record_stream")
_WRITE_ONLY = ("aten.copy_", "aten.index_copy_", "aten.fill_", "aten.zero_", "aten.zeros",
               "aten.ones", "aten.full", "aten.zeros_like", "aten.ones_like", "aten.full_like")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _op_bytes(func, args, kwargs, out) -> int:
    """Bytes ``func`` reads and writes: its tensor inputs plus its tensor outputs, none for a
    view, and no read of the destination of a copy, an index copy or a fill."""
    name = str(func.overloadpacket)
    rets = func._schema.returns
    if name.startswith(_FREE) or (rets and all(
            r.alias_info is not None and not r.alias_info.is_write for r in rets)):
        return 0
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if name.startswith(_WRITE_ONLY):
        ins = ins[1:] if ins and outs and ins[0] is outs[0] else ins
    return sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))


def _site() -> str:
    """The innermost fsdp_qcomm function on the stack, or FSDP2 / model / optimizer."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(_PKG):
            return f"{Path(fn).relative_to(ROOT)}:{f.f_code.co_name}"
        f = f.f_back
    return _OTHER


@dataclass
class Census:
    """Operations of one step: ``ops[(site, op)] = [count, bytes, launches]`` (a launch: an
    operation that moves bytes, a kernel on CUDA); ``codec[(kernel, row)] = [calls, elements,
    bytes]``."""

    ops: dict = field(default_factory=dict)
    codec: dict = field(default_factory=dict)

    def add_op(self, site: str, op: str, nbytes: int) -> None:
        c = self.ops.setdefault((site, op), [0, 0, 0])
        c[0] += 1
        c[1] += nbytes
        c[2] += nbytes > 0

    def add_codec(self, kernel: str, row: str, elements: int, nbytes: int) -> None:
        c = self.codec.setdefault((kernel, row), [0, 0, 0])
        c[0] += 1
        c[1] += elements
        c[2] += nbytes


class _Mode(TorchDispatchMode):
    """Records each tensor operation outside codec calls (those are one kernel each on CUDA)."""

    def __init__(self, census: Census) -> None:
        super().__init__()
        self.census = census
        self.inside_codec = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside_codec:
            name = str(func.overloadpacket)
            if not name.startswith(("c10d.", "_c10d_functional.")):
                self.census.add_op(_site(), name, _op_bytes(func, args, kwargs or {}, out))
        return out


def bench_row(kernel: str, a: tuple) -> str:
    """The row of ``gpu_kernels_bench.py``'s table that stands for this codec call (same
    kernel and the same fused extras; widths and group sizes may differ)."""
    if kernel == "quantize":
        x, spec, _key, ref, hadamard = a[:5]
        if ref is not None:
            return "quantize 4b g2048 sym stoch x-ref (qWD)"
        if hadamard:
            return f"quantize {8 if spec.bits == 8 else 4}b g128 sym stoch +H32"
        if x.dtype == torch.bfloat16:
            return "quantize 8b g1024 asym stoch bf16 in"
        return "quantize 4b g128 sym stoch"
    if kernel in ("dequantize", "dequantize_segments"):
        hadamard, accumulate = a[3], a[5]
        if accumulate:
            return "dequantize 4b g2048 += fp32 (qWD)"
        return "dequantize 8b g128 +H32^-1 -> fp32" if hadamard else \
            "dequantize 8b g1024 asym -> bf16"
    if kernel == "reduce_requantize":
        return "reduce_requantize k=8 8b->4b g128"
    if kernel == "reduce_dequantize":
        return AVG_ROW if len(a) > 5 and a[5] is not None else _PLAIN_LAST_HOP
    if kernel == "quantize_levels":
        bits = a[1].bits
        return ("quantize_levels 8b g1024 asym stoch (QSDP)" if bits == 8 else
                _LOWBIT_LEVELS if bits <= 2 else "quantize_levels 4b g1024 asym stoch")
    if kernel == "dequantize_levels_sum":
        return ("dequantize_levels 4b g1024 += fp32" if len(a) > 4 and a[4] else
                "dequantize_levels 8b g1024 -> bf16")
    raise ValueError(f"no bandwidth row for codec function {kernel}")


def _label(kernel: str, a: tuple, out: torch.Tensor) -> str:
    """The call as the bandwidth table names its cases: widths, group, extras, dtypes."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if kernel in ("quantize", "quantize_levels"):
        spec, extra = a[1], ""
        if kernel == "quantize":
            extra = (" x-ref" if a[3] is not None else "") + (" +H32" if a[4] else "")
        return (f"{kernel} {spec.bits}b g{spec.group_size}{extra} "
                f"{short.get(a[0].dtype, a[0].dtype)} in")
    if kernel in ("dequantize", "dequantize_segments", "dequantize_levels_sum"):
        spec, uniform = a[2], kernel != "dequantize_levels_sum"
        o = a[4] if uniform else a[3]
        acc = a[5] if uniform else a[4]
        had = " +H32^-1" if uniform and a[3] else ""
        res = o if o is not None else out
        return (f"{kernel} {spec.bits}b g{spec.group_size}{had} "
                f"{'+=' if acc else '->'} {short.get(res.dtype, res.dtype)}")
    spec = a[2]
    k = len(a[0])
    if kernel == "reduce_requantize":
        return f"{kernel} k={k} {spec.bits}b->{a[3].bits}b g{a[3].group_size}"
    avg = " /W" if len(a) > 5 and a[5] is not None else ""
    return f"{kernel} k={k} {spec.bits}b g{spec.group_size}{' +H32^-1' if a[3] else ''}{avg}"


def _moved(kernel: str, a: tuple, out: torch.Tensor) -> tuple[int, int]:
    """(elements, bytes read and written) of one codec call, as the bandwidth bench counts."""
    if kernel in ("quantize", "quantize_levels"):
        x, ref = a[0], (a[3] if kernel == "quantize" else None)
        return x.numel(), _nbytes(x) + (_nbytes(ref) if ref is not None else 0) + _nbytes(out)
    if kernel in ("dequantize", "dequantize_segments"):
        data, o, acc = a[0], a[4], a[5]
        res = o if o is not None else out
        base = a[6][1] if len(a) > 6 and a[6] is not None else None  # its row, written twice
        return res.numel(), (_nbytes(data) + _nbytes(res) * (2 if acc else 1)
                             + (_nbytes(base) if base is not None else 0))
    seq = a[0]
    res = out if isinstance(out, torch.Tensor) else a[-1]
    acc = kernel == "dequantize_levels_sum" and len(a) > 4 and a[4]
    return res.numel(), sum(map(_nbytes, seq)) + _nbytes(res) * (2 if acc else 1)


#: codec functions that are one kernel on CUDA and a loop of others on the CPU: the
#: ``_Recorder`` method that stands in for each
_ONE_LAUNCH = {"dequantize_segments": "_segments", "quantize_segments": "_quantize_segments",
               "quantize_ordered": "_quantize_ordered"}


class _Recorder:
    """Stands in for the codec implementation module: records each call, then runs it."""

    def __init__(self, impl, mode: _Mode) -> None:
        self._impl, self._mode = impl, mode

    def _segments(self, rows, segs, spec, hadamard, out, accumulate, row_base=None):
        """The CPU implementations' loop of ``codec.dequantize_segments`` (a kernel on CUDA,
        which adds ``row_base``'s row to its base in the same pass: copies here)."""
        from fsdp_qcomm.codec import _each_segment, _through_row_base

        _through_row_base(out, row_base, lambda: _each_segment(self._impl, rows, segs, spec,
                                                               hadamard, out, accumulate))
        return out

    def _quantize_segments(self, x, segs, spec, key, key_salt, ref, hadamard, out):
        """The CPU implementations' loop of ``codec.quantize_segments`` (a kernel on CUDA)."""
        from fsdp_qcomm.codec import _each_quantize, _widths

        if out is None:
            out = torch.empty(sum(_widths(segs, spec, hadamard)), dtype=torch.uint8)
        return _each_quantize(self._impl, x, segs, spec, key, key_salt, ref, hadamard, out)

    def _quantize_ordered(self, rows, spec, key, ref, hadamard, order):
        """The CPU implementations' ``quantize``, then its rows in ``order`` (one kernel on
        CUDA: ``kernels.quantize_ordered``)."""
        return self._impl.quantize(rows, spec, key, ref, hadamard, None)[list(order)]

    def __getattr__(self, kernel: str):
        fn = getattr(self._impl, kernel, None)
        if fn is None and kernel in _ONE_LAUNCH:  # one launch on CUDA: counted as one call
            fn = getattr(self, _ONE_LAUNCH[kernel])
        elif fn is None:
            raise AttributeError(kernel)

        def call(*a):
            self._mode.inside_codec += 1
            try:
                out = fn(*a)
            finally:
                self._mode.inside_codec -= 1
            name, args = kernel, a
            if kernel == "quantize_segments":  # counted as the quantize of the whole row
                name, args = "quantize", (a[0], a[2], a[3], a[5], a[6])
            elif kernel == "quantize_ordered":  # as the quantize of the rows (a permutation)
                name, args = "quantize", a[:5]
            elements, nbytes = _moved(name, args, out)
            label = _label(name, args, out).replace(name, kernel, 1)
            row = bench_row(name, args)
            if kernel.endswith("_segments"):
                row = _GROUPED.get(row, row)
            elif kernel == "quantize_ordered":
                row = _REORDERED.get(row, row)
            values = a[4] if kernel == "dequantize_segments" else (
                a[0] if kernel.startswith("quantize") else None)
            if values is not None and values.dtype == torch.bfloat16:
                row = BF16_ROWS.get(row, row)
            self._mode.census.add_codec(label, row, elements, nbytes)
            return out

        return call


def count_step(shape: LlamaShape, world: int, per_node: int, preset: Optional[str],
               warmup: int = 2, torch_digest: bool = False) -> tuple[Census, int]:
    """One counted training step after ``warmup`` (the first gathers send full precision)."""
    from fsdp_qcomm import codec
    from fsdp_qcomm.codec import levels

    step, handle, padded = build_step(shape, world, per_node, preset, "cpu", torch.bfloat16)
    for _ in range(warmup):
        step()
    census = Census()
    mode = _Mode(census)
    impl, impl_levels = codec._impl, levels._impl
    codec._impl = levels._impl = lambda *t: _Recorder(impl(*t), mode)
    try:
        with _as_on_cuda(mode, torch_digest), mode:
            step()
    finally:
        codec._impl, levels._impl = impl, impl_levels
        if handle is not None:
            handle.disable()
        torch.distributed.destroy_process_group()
    return census, padded


@contextlib.contextmanager
def _as_on_cuda(mode: Optional[_Mode] = None, torch_digest: bool = False):
    """The CUDA path's choices on CPU tensors: shard digests as CUDA takes them (a zeroed vector
    and one Triton kernel per element width over every group the agreement asks about
    (``change_tracker._kernel_plan``), each launch counted like a codec call and priced at
    clone's GB/s; the torch formula for tensors the kernel does not read, or for all with
    ``torch_digest``: what CUDA ran before ``kernels/digest.py``) and gradient reductions
    finished inside their call (the CPU path may defer them to a thread, which the census
    would not see)."""
    from fsdp_qcomm.fsdp import change_tracker, reduce_scatter

    digests, defer = change_tracker.shard_digests, reduce_scatter.defer_reason

    def shard_digests(groups):
        plan, rest = ([], []) if torch_digest else change_tracker._kernel_plan(groups)
        if not plan:
            return torch.stack([change_tracker._torch_digest(g) for g in groups])
        for x, position, _ in rest:  # CUDA's torch formula for what the kernel does not read
            change_tracker._torch_digest([x], position)
        if mode is None:
            return digests(groups)
        mode.inside_codec += 1
        try:
            out = digests(groups)  # the C loop: the same values
        finally:
            mode.inside_codec -= 1
        site = f"{Path(change_tracker.__file__).relative_to(ROOT)}:shard_digests"
        mode.census.add_op(site, "aten.zeros", 8 * len(groups))
        for tensors, _, _ in plan:  # one launch per element width
            mode.census.add_codec(f"digest {tensors[0].dtype}".replace("torch.", ""),
                                  CLONE_ROW, sum(x.numel() for x in tensors),
                                  sum(map(_nbytes, tensors)))
        return out

    change_tracker.shard_digests = shard_digests
    reduce_scatter.defer_reason = lambda *a: "counted as on CUDA"
    try:
        yield
    finally:
        change_tracker.shard_digests, reduce_scatter.defer_reason = digests, defer


class _NoCodec:
    """Stands in for the codec's implementation in ``host_ms``: outputs of the right shape and
    no work (zero codes; a decode leaves ``out`` as it is)."""

    @staticmethod
    def _wire(count, n, spec, hadamard):
        """``count`` zero wire rows of ``n`` values (``hadamard``: padded to 32-blocks)."""
        from fsdp_qcomm.codec import wire

        m = wire.hadamard_len(n) if hadamard else n
        return torch.zeros(count, wire.wire_bytes(m, spec), dtype=torch.uint8)

    @staticmethod
    def quantize(rows, spec, key, ref, hadamard, out=None):
        if out is not None:
            return out
        return _NoCodec._wire(rows.shape[0], rows.shape[1], spec, hadamard)

    @staticmethod
    def quantize_ordered(rows, spec, key, ref, hadamard, order):
        return _NoCodec._wire(len(order), rows.shape[1], spec, hadamard)

    @staticmethod
    def quantize_segments(x, segs, spec, key, key_salt, ref, hadamard, out):
        from fsdp_qcomm.codec import _widths

        if out is not None:
            return out
        return torch.zeros(sum(_widths(segs, spec, hadamard)), dtype=torch.uint8)

    @staticmethod
    def dequantize(rows, n, spec, hadamard, out, accumulate):
        return out if out is not None else torch.zeros(rows.shape[0], n)

    @staticmethod
    def dequantize_segments(rows, segs, spec, hadamard, out, accumulate, row_base=None):
        return out

    @staticmethod
    def reduce_requantize(seq, n, spec_in, spec_out, key):
        from fsdp_qcomm.codec import wire

        return torch.zeros(seq[0].shape[0], wire.wire_bytes(n, spec_out), dtype=torch.uint8)

    @staticmethod
    def reduce_dequantize(seq, n, spec, hadamard, out, divide=None):
        return out if out is not None else torch.zeros(seq[0].shape[0], n)

    @staticmethod
    def quantize_levels(rows, spec, levels, key):
        from fsdp_qcomm.codec import wire

        return torch.zeros(rows.shape[0], wire.levels_wire_bytes(rows.shape[1], spec),
                           dtype=torch.uint8)

    @staticmethod
    def dequantize_levels_sum(seq, n, spec, out=None, accumulate=False):
        return out if out is not None else torch.zeros(seq[0].shape[0], n)


def host_ms(shape: LlamaShape, world: int, per_node: int, preset: str, steps: int = 10,
            rounds: int = 5, torch_digest: bool = False) -> dict:
    """The host time per step the hooks add, with the codec's work taken out (``_NoCodec``):
    their Python, dispatch and the glue's operations on the counted model's small tensors, on
    this CPU. fp32 parameters keep the model's own CPU time small; runs without and with
    ``enable`` alternate, ``rounds`` times; each side's fastest step counts (the work is the
    same every step: the fastest is the least disturbed), and ``added_range`` is the spread of
    the rounds' differences (the noise)."""
    from fsdp_qcomm import codec
    from fsdp_qcomm.codec import levels

    runs: dict[str, list[float]] = {"fsdp2": [], preset: []}
    impl, impl_levels = codec._impl, levels._impl
    for _ in range(rounds):
        for p in (None, preset):
            step, handle, _ = build_step(shape, world, per_node, p, "cpu", torch.float32)
            codec._impl = levels._impl = lambda *t: _NoCodec
            try:
                with _as_on_cuda(None, torch_digest):
                    for _ in range(2):
                        step()
                    times = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        step()
                        times.append(time.perf_counter() - t0)
            finally:
                codec._impl, levels._impl = impl, impl_levels
                if handle is not None:
                    handle.disable()
                torch.distributed.destroy_process_group()
            runs[p or "fsdp2"].append(1e3 * min(times))
    out = {k: min(v) for k, v in runs.items()}
    out["added"] = out[preset] - out["fsdp2"]
    out["runs"] = runs
    per_round = [b - a for a, b in zip(runs["fsdp2"], runs[preset])]
    out["added_range"] = [min(per_round), max(per_round)]
    return out


def padded_params(shape: LlamaShape, world: int) -> int:
    """FSDP2's padded parameter count: each parameter's dim 0 padded to a multiple of W."""
    hd = shape.dim // shape.heads
    mats = [(shape.heads * hd, shape.dim), (shape.kv_heads * hd, shape.dim),
            (shape.kv_heads * hd, shape.dim), (shape.dim, shape.heads * hd),
            (shape.ffn, shape.dim), (shape.ffn, shape.dim), (shape.dim, shape.ffn),
            (shape.dim,), (shape.dim,)]
    per = lambda s: -(-s[0] // world) * world * (s[1] if len(s) > 1 else 1)  # noqa: E731
    top = [(shape.vocab, shape.dim), (shape.vocab, shape.dim), (shape.dim,)]
    return shape.layers * sum(map(per, mats)) + sum(map(per, top))


def price(base: Census, enabled: Census, scale: float, bandwidth: dict) -> dict:
    """Milliseconds per step at the target: codec calls at their kernel's measured GB/s, the
    other operations at clone's; FSDP2/model/optimizer work as the change against the run
    without ``enable``."""
    clone = bandwidth["clone_gbps"] * 1e9
    rows = {c["case"]: c["gbps"] * 1e9 for c in bandwidth["cases"] if c.get("gbps")}
    rows[CLONE_ROW] = clone
    kernels = []
    for (kernel, row), (calls, elems, nbytes) in sorted(enabled.codec.items()):
        while row not in rows and row in _STAND_IN:  # a stand-in may have one itself
            row = _STAND_IN[row]
        kernels.append({"kernel": kernel, "row": row, "calls": calls,
                        "elements": elems * scale, "gbytes": nbytes * scale / 1e9,
                        "ms": nbytes * scale / rows[row] * 1e3, "gbps": rows[row] / 1e9})
    glue: dict[str, list] = {}
    for (site, op), (_, nbytes, launches) in enabled.ops.items():
        if site != _OTHER and launches:
            g = glue.setdefault(site, [0, 0, {}])
            g[0] += launches
            g[1] += nbytes
            g[2][op] = g[2].get(op, 0) + nbytes
    sites = [{"site": s, "launches": n, "gbytes": b * scale / 1e9,
              "ms": b * scale / clone * 1e3,
              "top_ops": [(o, v * scale / 1e9) for o, v in
                          sorted(ops.items(), key=lambda kv: -kv[1])[:3]]}
             for s, (n, b, ops) in glue.items()]
    sites.sort(key=lambda r: -r["ms"])

    def other(c: Census) -> tuple[int, int]:
        vals = [v for (s, _), v in c.ops.items() if s == _OTHER]
        return sum(v[2] for v in vals), sum(v[1] for v in vals)

    (n0, b0), (n1, b1) = other(base), other(enabled)
    fsdp = {"launches": n1 - n0, "gbytes": (b1 - b0) * scale / 1e9,
            "ms": (b1 - b0) * scale / clone * 1e3}
    kernel_ms, glue_ms = sum(k["ms"] for k in kernels), sum(s["ms"] for s in sites)
    return {"kernels": kernels, "glue": sites, "fsdp_model_optimizer_change": fsdp,
            "kernel_ms": kernel_ms, "glue_ms": glue_ms, "floor_ms": kernel_ms + glue_ms
            + fsdp["ms"], "launches_added": sum(k["calls"] for k in kernels)
            + sum(s["launches"] for s in sites) + n1 - n0}


def _measured(gpu_check: dict, target: str, world: int, per_node: int,
              preset: str) -> Optional[dict]:
    """The GPU run's ``step_cost`` row for this shape and layout: it measures sdp4bit only."""
    if preset != "sdp4bit":
        return None
    for r in gpu_check["steps"].get("step_cost", {}).get("result", {}).get("rows", []):
        if (r["shape"]["name"], r["world"], r["ranks_per_node"]) == (target, world, per_node):
            return {"fsdp2_ms": r["fsdp2"]["ms"], "enabled_ms": r["enabled"]["ms"],
                    "codec_ms": r["codec_ms"]}
    return None


def report(res: dict) -> str:
    p, m = res["priced"], res["measured"]
    lines = [
        f"# What enable({res['preset']}) adds to a {res['target']} step at W={res['world']}, "
        f"G={res['ranks_per_node']}: counted on the CPU, priced at {res['device']}'s bandwidth",
        "",
        f"Counted: the `{res['counted']}` shape ({res['counted_padded'] / 1e6:.2f}M padded "
        f"parameters, {res['counted_layers']} layers), scaled x{res['scale']:.0f} to "
        f"{res['target_padded'] / 1e9:.3f}B. Bandwidths: `{res['bandwidth_source']}` "
        f"(clone {res['clone_gbps']:.0f} GB/s).",
        "",
        "| codec kernel (bandwidth row) | calls | G elements | GB moved | GB/s | ms |",
        "|---|---|---|---|---|---|",
    ]
    for k in sorted(p["kernels"], key=lambda k: -k["ms"]):
        lines.append(f"| {k['kernel']} ({k['row']}) | {k['calls']} | {k['elements'] / 1e9:.3f} "
                     f"| {k['gbytes']:.2f} | {k['gbps']:.0f} | {k['ms']:.2f} |")
    lines += ["", "| other work of fsdp_qcomm (innermost function) | launches | GB moved "
              "| ms at clone's GB/s | largest ops (GB) |", "|---|---|---|---|---|"]
    for s in p["glue"]:
        top = ", ".join(f"{o.replace('aten.', '')} {g:.2f}" for o, g in s["top_ops"])
        lines.append(f"| {s['site']} | {s['launches']} | {s['gbytes']:.2f} | {s['ms']:.2f} "
                     f"| {top} |")
    f = p["fsdp_model_optimizer_change"]
    lines += [
        "",
        f"FSDP2, model and optimizer with enable against without: {f['launches']:+d} launches, "
        f"{f['gbytes']:+.2f} GB, {f['ms']:+.2f} ms.",
        "",
        f"Floor of the codec's GPU time per step: **{p['floor_ms']:.1f} ms** "
        f"({p['kernel_ms']:.1f} in codec kernels, {p['glue_ms']:.1f} in other fsdp_qcomm work, "
        f"{f['ms']:+.1f} in FSDP2's), with {p['launches_added']} more launches per step.",
    ]
    h = res.get("host_ms")
    if h:
        lines.append(
            f"Host time the hooks add per step with the codec's work taken out (Python, "
            f"dispatch, small tensors; this CPU, the counted shape in fp32): "
            f"{h['added']:+.1f} ms ({h['fsdp2']:.1f} -> {h[res['preset']]:.1f} ms, fastest "
            f"steps of {len(h['runs']['fsdp2'])} alternating runs each; the runs' differences "
            f"{h['added_range'][0]:+.1f} to {h['added_range'][1]:+.1f} ms).")
    if m:
        lines.append(
            f"Measured by that GPU run (with its own commit's code): {m['enabled_ms']:.1f} ms "
            f"against {m['fsdp2_ms']:.1f} ms, codec {m['codec_ms']:.1f} ms; this floor is "
            f"{100 * p['floor_ms'] / m['codec_ms']:.0f}% of it.")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="1B", choices=sorted(set(SHAPES) - {"tiny"}))
    p.add_argument("--world", default="8:1", help="W:G (G ranks per node)")
    p.add_argument("--preset", default="sdp4bit")
    p.add_argument("--gpu-check", default=str(DEFAULT_GPU_CHECK),
                   help="a gpu_check.json whose bandwidth step prices the counts")
    p.add_argument("--out", default="", help="folder for the report (.md) and counts (.json)")
    p.add_argument("--label", default="", help="prefix of the files' names in --out")
    p.add_argument("--host-steps", type=int, default=10,
                   help="steps per timed run of host_ms (0: no host timing)")
    p.add_argument("--torch-digest", action="store_true",
                   help="shard digests by the torch formula, as CUDA ran them before "
                        "kernels/digest.py (commit 24f5c64 and earlier)")
    a = p.parse_args(argv)
    if a.out:
        _provenance.record(Path(a.out), argv=None if argv is None else [__file__, *argv])
    world, per_node = (int(v) for v in a.world.split(":"))
    gpu_check = json.loads(Path(a.gpu_check).read_text())
    bandwidth = gpu_check["steps"]["bandwidth"]["result"]
    t0 = time.perf_counter()
    target = SHAPES[a.target]
    shape = counted_shape(target)
    base, counted = count_step(shape, world, per_node, None)
    enabled, _ = count_step(shape, world, per_node, a.preset, torch_digest=a.torch_digest)
    target_padded = padded_params(target, world)
    scale = target_padded / counted
    res: dict[str, Any] = {
        "preset": a.preset, "torch_digest": a.torch_digest, "target": a.target, "world": world,
        "ranks_per_node": per_node,
        "counted": shape.name, "counted_layers": shape.layers, "counted_padded": counted,
        "target_padded": target_padded,
        "scale": scale, "device": bandwidth.get("device", "?"),
        "bandwidth_source": str(Path(a.gpu_check).resolve().relative_to(ROOT))
        if Path(a.gpu_check).resolve().is_relative_to(ROOT) else a.gpu_check,
        "clone_gbps": bandwidth["clone_gbps"],
        "priced": price(base, enabled, scale, bandwidth),
        "measured": _measured(gpu_check, a.target, world, per_node, a.preset),
        "host_ms": host_ms(shape, world, per_node, a.preset, a.host_steps,
                           torch_digest=a.torch_digest) if a.host_steps else None,
        "count_s": time.perf_counter() - t0,
        "raw": {"fsdp2": {f"{s} | {o}": v for (s, o), v in base.ops.items()},
                "enabled": {f"{s} | {o}": v for (s, o), v in enabled.ops.items()},
                "codec": {f"{k} | {r}": v for (k, r), v in enabled.codec.items()}},
    }
    text = report(res)
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"{a.label + '_' if a.label else ''}{a.preset}_{a.target}_W{world}G{per_node}"
        (out / f"{name}.md").write_text(text + "\n")
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
