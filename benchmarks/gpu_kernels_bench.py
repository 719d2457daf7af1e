"""Benchmark of the codec's Triton kernels on a GPU: exactness first, then bandwidth.

For every fused kernel (quantize with/without ref and Hadamard, dequantize with/without
accumulate, reduce+requantize, reduce+dequantize+inverse Hadamard) it

1. checks the kernel on CUDA against the torch codec run on CPU copies of the same inputs
   (wire bytes equal; decoded floats equal bit for bit, NaNs at the same places), on rows of
   odd length with NaN/Inf groups;
2. times it on a large input (default 256M fp32 elements = 1 GiB; fewer if memory is short)
   and prints the bandwidth it achieves (bytes it must read and write / the device's time)
   next to the device's copy bandwidth measured with ``torch.clone``; the target is >= 0.7x.
   The device's time excludes the call's host time (``_time``), printed beside it.

Each case runs on its own: a failure is printed and the others still run. The exit status is
1 if any check failed or crashed (``--strict``: also if a kernel is below the target).

    python benchmarks/gpu_kernels_bench.py [--numel N] [--rows R] [--iters I]
        [--check-numel M] [--only SUBSTRING] [--tile T] [--strict] [--interpret] [--json FILE]

Without CUDA it prints why and exits 0. ``--interpret`` runs a small version on the CPU under
the Triton interpreter: a smoke test of this script, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.7
#: the gradient's last hop as training runs it under FSDP's AVG: the division in the same pass
AVG_ROW = "reduce_dequantize k=4 4b g128 +H32^-1 /4 (AVG)"
#: rows in bf16, as training with bf16 parameters runs them, by their fp32 row: qWD's grouped
#: rows, and the gradient encoders, which read FSDP's bf16 gradients since the reduce-scatter
#: input holds them in their own dtype (``fsdp.reduce_scatter._input_dtype``)
_HOP1 = "quantize 8b g128 sym stoch +H32, rows reordered (gradient hop 1)"
BF16_ROWS = {"quantize_segments 4b g2048 x-ref (9 segments)":
             "quantize_segments 4b g2048 x-ref bf16 (9 segments)",
             "dequantize_segments 4b g2048 += fp32 (9 segments)":
             "dequantize_segments 4b g2048 += bf16 (9 segments)",
             "quantize 4b g128 sym stoch +H32": "quantize 4b g128 sym stoch +H32 bf16 in",
             _HOP1: f"{_HOP1}, bf16 in"}
#: rows that take one thing out of a slow kernel, so a single GPU run says where its time goes:
#: {diagnostic row: (the row it differs from, what it leaves out)}; each writes as many values
#: as that row, so the time it saves is what it leaves out. They have no goal, and the tile
#: sweep skips them (``--no-diagnostics``).
DIAGNOSTICS = {
    "dequantize_segments 4b g2048 += fp32 (1 segment)":
        ("dequantize_segments 4b g2048 += fp32 (9 segments)",
         "8 of the 9 segments; the grouped launch's table lookups stay"),
    "quantize 4b g128 sym nearest":
        ("quantize 4b g128 sym stoch", "stochastic rounding's random numbers"),
    "reduce_requantize k=1 8b->4b g128":
        ("reduce_requantize k=8 8b->4b g128", "7 of the 8 chunks' loads and decodes"),
}
sys.path.insert(0, str(ROOT / "benchmarks"))
import _provenance  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=256 * 1024 * 1024,
                   help="elements of the timed input (default 256M = 1 GiB of fp32)")
    p.add_argument("--rows", type=int, default=8, help="rows (destination ranks) of the input")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per kernel")
    p.add_argument("--check-numel", type=int, default=1 << 20,
                   help="elements of the exactness check inputs")
    p.add_argument("--only", default="", help="run only cases whose name contains this")
    p.add_argument("--tile", type=int, default=0,
                   help="elements per program (a power of 2 >= 256; default: the kernels' own)")
    p.add_argument("--strict", action="store_true", help="exit 1 if a kernel is below target")
    p.add_argument("--no-diagnostics", action="store_true",
                   help="leave out the rows that isolate one cost of another (DIAGNOSTICS)")
    p.add_argument("--interpret", action="store_true",
                   help="CPU smoke test under the Triton interpreter (small sizes)")
    p.add_argument("--json", default="", help="also write the table to this JSON file")
    return p.parse_args()


def _load(interpret: bool):
    """This checkout's fsdp_qcomm and its kernels/ folder as ``fsdp_qcomm.kernels``."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(ROOT))
    import fsdp_qcomm.kernels as kernels

    return kernels


@dataclass
class Case:
    """One kernel configuration. ``run(impl, inputs)`` calls ``impl`` (the kernels module or
    ``torch_codec``: same functions, same signatures) and returns its result."""

    name: str
    make: Callable  # (rows, n, device, check) -> dict of inputs
    run: Callable  # (impl, inputs) -> tensor
    moved: Callable  # (inputs, result) -> bytes the kernel must read and write
    timed: bool = True

    @property
    def diagnostic(self) -> bool:
        """A row that isolates one cost of another (``DIAGNOSTICS``): no goal, no tile sweep."""
        return self.name in DIAGNOSTICS


def _cases(torch, QuantSpec, RngKey, torch_codec, codec) -> list[Case]:
    key = RngKey(seed=1, step=2, rank=3, bucket=4)

    def values(rows, n, dev, check, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(rows, n, generator=g, device=dev)
        if check and n > 300:
            x[0, n // 3] = float("nan")
            x[-1, n // 2] = float("inf")
        return x

    def encode(x, spec, k, hadamard, check):
        # Checks decode bytes made by the torch codec; timed inputs are made by the kernel.
        if check:
            return torch_codec.quantize(x.cpu(), spec, k, None, hadamard).to(x.device)
        return _K.quantize(x, spec, k, None, hadamard)

    def nbytes(t):
        return t.numel() * t.element_size()

    def quant(name, spec, dtype=torch.float32, ref=False, hadamard=False):
        def make(rows, n, dev, check):
            x = values(rows, n, dev, check, 0)
            d = {"x": x.to(dtype), "ref": None}
            if ref:
                d["ref"] = (x + 0.01 * values(rows, n, dev, False, 1)).to(dtype)
            return d

        return Case(
            name, make,
            run=lambda impl, d: impl.quantize(d["x"], spec, key, d["ref"], hadamard),
            moved=lambda d, out: nbytes(d["x"]) + (nbytes(d["ref"]) if ref else 0) + nbytes(out),
        )

    def quant_ordered(name, spec, hadamard=False, dtype=torch.float32):
        # The gradient's first hop: rows encoded in its send order (here reversed), one launch;
        # the torch codec encodes them in order, then gathers the rows.
        def make(rows, n, dev, check):
            return {"x": values(rows, n, dev, check, 0).to(dtype),
                    "order": tuple(reversed(range(rows)))}

        def run(impl, d):
            if hasattr(impl, "quantize_ordered"):
                return impl.quantize_ordered(d["x"], spec, key, None, hadamard, d["order"])
            return impl.quantize(d["x"], spec, key, None, hadamard)[list(d["order"])]

        return Case(name, make, run, moved=lambda d, out: nbytes(d["x"]) + nbytes(out))

    def dequant(name, spec, out_dtype=None, accumulate=False, hadamard=False):
        def make(rows, n, dev, check):
            d = {"data": encode(values(rows, n, dev, check, 0), spec, key, hadamard, check),
                 "n": n, "out": None}
            if out_dtype is not None:
                d["out"] = values(rows, n, dev, False, 1).to(out_dtype)
            return d

        return Case(
            name, make,
            run=lambda impl, d: impl.dequantize(d["data"], d["n"], spec, hadamard, d["out"],
                                                accumulate),
            moved=lambda d, out: nbytes(d["data"]) + nbytes(out) * (2 if accumulate else 1),
        )

    def shard(n, parts, align):
        """``parts`` parameter sizes that add up to n: multiples of ``align`` (8: what a
        model's shards hold, and what the kernels' aligned variant needs, the rest in the last
        part) or, with align 1, sizes that differ by one (odd ones among them)."""
        if align == 1:
            return [n // parts + (j < n % parts) for j in range(parts)]
        base = n // parts // align * align
        return [base] * (parts - 1) + [n - base * (parts - 1)]

    def dequant_segments(name, spec, parts, align=8, dtype=torch.float32):
        # A weight shard of ``parts`` parameters, each encoded on its own (qWD's rows), decoded
        # and added into ``dtype`` in one launch; the torch codec decodes segment by segment.
        def make(rows, n, dev, check):
            segs = shard(n, parts, align)
            data = torch.cat([encode(values(rows, m, dev, check and j == 1, j), spec,
                                     key.fold(j), False, check) for j, m in enumerate(segs)], 1)
            return {"data": data, "segs": tuple(segs),
                    "out": values(rows, n, dev, False, 1).to(dtype)}

        def run(impl, d):
            # into d["out"] itself, as ``dequant`` does: a copy here would be timed with it
            out = d["out"]
            if hasattr(impl, "dequantize_segments"):
                return impl.dequantize_segments(d["data"], d["segs"], spec, False, out, True)
            return codec._each_segment(impl, d["data"], d["segs"], spec, False, out, True)

        return Case(name, make, run,
                    moved=lambda d, out: nbytes(d["data"]) + 2 * nbytes(out))

    def quant_segments(name, spec, parts, dtype=torch.float32):
        # qWD's send: a shard of ``parts`` parameters in ``dtype``, each encoded on its own
        # against the reference, in one launch; the torch codec encodes segment by segment.
        def make(rows, n, dev, check):
            x = values(1, rows * n, dev, check, 0)[0]
            segs = shard(x.numel(), parts, 8)
            ref = x + 0.01 * values(1, x.numel(), dev, False, 1)[0]
            return {"x": x.to(dtype), "ref": ref.to(dtype), "segs": tuple(segs)}

        def run(impl, d):
            if hasattr(impl, "quantize_segments"):
                return impl.quantize_segments(d["x"], d["segs"], spec, key, 1 << 40, d["ref"])
            out = torch.empty(sum(codec._widths(d["segs"], spec, False)),
                              dtype=torch.uint8, device=d["x"].device)
            return codec._each_quantize(impl, d["x"], d["segs"], spec, key, 1 << 40, d["ref"],
                                        False, out)

        return Case(name, make, run,
                    moved=lambda d, out: nbytes(d["x"]) + nbytes(d["ref"]) + nbytes(out))

    def reduce(name, k, spec, spec_out=None, hadamard=False, divide=None, like=None):
        def make(rows, n, dev, check):
            # k chunks hold the input's elements together (``like``: a row of that many
            # chunks, so that a diagnostic row has its output's size)
            n = max(8, n // (like or k))
            blocks = [encode(values(rows, n, dev, check and j == 1, j), spec, key.fold(j),
                             hadamard, check) for j in range(k)]
            return {"chunks": torch.stack(blocks), "n": n}

        if spec_out is not None:
            run = lambda impl, d: impl.reduce_requantize(  # noqa: E731
                list(d["chunks"].unbind(0)), d["n"], spec, spec_out, key)
        else:
            run = lambda impl, d: impl.reduce_dequantize(  # noqa: E731
                list(d["chunks"].unbind(0)), d["n"], spec, hadamard, None, divide)
        return Case(name, make, run, moved=lambda d, out: nbytes(d["chunks"]) + nbytes(out))

    def levels_quant(name, spec):
        def make(rows, n, dev, check):
            return {"x": values(rows, n, dev, check, 0), "table": table(spec).to(dev)}

        return Case(
            name, make,
            run=lambda impl, d: impl.quantize_levels(d["x"], spec, d["table"], key),
            moved=lambda d, out: nbytes(d["x"]) + nbytes(out),
        )

    def levels_dequant(name, spec, out_dtype=None, accumulate=False):
        def make(rows, n, dev, check):
            x = values(rows, n, dev, check, 0)
            if check:
                data = torch_codec.quantize_levels(x.cpu(), spec, table(spec), key).to(dev)
            else:
                data = _K.quantize_levels(x, spec, table(spec).to(dev), key)
            d = {"data": data, "n": n, "out": None}
            if out_dtype is not None:
                d["out"] = values(rows, n, dev, False, 1).to(out_dtype)
            return d

        return Case(
            name, make,
            run=lambda impl, d: impl.dequantize_levels_sum([d["data"]], d["n"], spec, d["out"],
                                                           accumulate),
            moved=lambda d, out: nbytes(d["data"]) + nbytes(out) * (2 if accumulate else 1),
        )

    def table(spec):
        """A fitted (non-uniform) level table for ``spec`` (deterministic)."""
        from fsdp_qcomm.codec import levels as lv

        g = torch.Generator().manual_seed(5)
        return lv.fit_levels(lv.histogram(torch.randn(4, 8192, generator=g) ** 3, spec), spec)

    def dispatch_run(impl, d):
        # Through the public API, which picks the kernels for CUDA tensors and the torch code
        # otherwise: 3-D rows, Hadamard, a round trip accumulated into bf16.
        data = codec.quantize(d["x"], s8, key, hadamard=True)
        out = torch.zeros(d["x"].shape, dtype=torch.bfloat16, device=d["x"].device)
        return codec.dequantize(data, d["x"].shape[-1], s8, hadamard=True, out=out,
                                accumulate=True)

    dispatch = Case(
        "fsdp_qcomm.codec dispatch (check only)",
        make=lambda rows, n, dev, check: {"x": values(rows, n, dev, check, 0).view(rows, 1, n)},
        run=dispatch_run, moved=lambda d, out: 0, timed=False,
    )

    def digest_run(impl, d):
        # The change tracker's shard digest (not a codec function): the kernel against the
        # torch formula, as one int64.
        if impl is torch_codec:
            from fsdp_qcomm.fsdp.change_tracker import _torch_digest

            return _torch_digest([d["x"]]).reshape(1)
        out = torch.zeros((), dtype=torch.int64, device=d["x"].device)
        sys.modules["fsdp_qcomm.kernels.digest"].digest_many([d["x"]], out)
        return out.reshape(1)

    digest = Case(
        "digest fp32 (change tracker, read only)",
        make=lambda rows, n, dev, check: {"x": values(rows, n, dev, check, 0).reshape(-1)},
        run=digest_run, moved=lambda d, out: nbytes(d["x"]),
    )

    s4 = QuantSpec(bits=4, group_size=128)
    s4n = QuantSpec(bits=4, group_size=128, rounding="nearest")
    s8 = QuantSpec(bits=8, group_size=128)
    w4 = QuantSpec(bits=4, group_size=2048)
    q8 = QuantSpec(bits=8, group_size=1024, symmetric=False)
    l4 = QuantSpec(bits=4, group_size=1024, symmetric=False)
    l2 = QuantSpec(bits=2, group_size=2048)  # lowbit's weights: 2-bit learned qWD
    return [
        quant("quantize 4b g128 sym stoch", s4),
        quant("quantize 4b g128 sym nearest", s4n),
        quant("quantize 8b g128 sym stoch +H32", s8, hadamard=True),
        quant("quantize 4b g128 sym stoch +H32", s4, hadamard=True),
        quant(BF16_ROWS["quantize 4b g128 sym stoch +H32"], s4, torch.bfloat16, hadamard=True),
        quant_ordered(_HOP1, s8, hadamard=True),
        quant_ordered(BF16_ROWS[_HOP1], s8, hadamard=True, dtype=torch.bfloat16),
        quant("quantize 4b g2048 sym stoch x-ref (qWD)", w4, ref=True),
        quant("quantize 8b g1024 asym stoch bf16 in", q8, dtype=torch.bfloat16),
        quant_segments("quantize_segments 4b g2048 x-ref (9 segments)", w4, 9),
        quant_segments(BF16_ROWS["quantize_segments 4b g2048 x-ref (9 segments)"], w4, 9,
                       torch.bfloat16),
        dequant("dequantize 4b g2048 += fp32 (qWD)", w4, torch.float32, accumulate=True),
        dequant_segments("dequantize_segments 4b g2048 += fp32 (9 segments)", w4, 9),
        dequant_segments(BF16_ROWS["dequantize_segments 4b g2048 += fp32 (9 segments)"], w4, 9,
                         dtype=torch.bfloat16),
        dequant_segments("dequantize_segments 4b g2048 += fp32 (9 odd segments)", w4, 9, 1),
        dequant_segments("dequantize_segments 4b g2048 += fp32 (1 segment)", w4, 1),
        dequant("dequantize 8b g1024 asym -> bf16", q8, torch.bfloat16),
        dequant("dequantize 8b g128 +H32^-1 -> fp32", s8, hadamard=True),
        reduce("reduce_requantize k=8 8b->4b g128", 8, s8, spec_out=s4),
        reduce("reduce_requantize k=1 8b->4b g128", 1, s8, spec_out=s4, like=8),
        reduce("reduce_dequantize k=4 4b g128 +H32^-1", 4, s4, hadamard=True),
        reduce(AVG_ROW, 4, s4, hadamard=True, divide=4.0),
        levels_quant("quantize_levels 8b g1024 asym stoch (QSDP)", q8),
        levels_quant("quantize_levels 4b g1024 asym stoch", l4),
        levels_quant("quantize_levels 2b g2048 sym stoch (lowbit)", l2),
        levels_dequant("dequantize_levels 8b g1024 -> bf16", q8, torch.bfloat16),
        levels_dequant("dequantize_levels 4b g1024 += fp32", l4, torch.float32, accumulate=True),
        digest,
        dispatch,
    ]


_K = None  # the kernels module (set in main; used to build large encoded inputs)


def _same_bits(torch, got, want) -> Optional[str]:
    """None if equal bit for bit (NaNs only need the same places), else what differs."""
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"dtype/shape {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    if not got.is_floating_point():
        bad = int((got != want).sum())
        return None if bad == 0 else f"{bad} of {got.numel()} bytes differ"
    ng, nw = torch.isnan(got), torch.isnan(want)
    if not torch.equal(ng, nw):
        return f"NaNs differ at {int((ng != nw).sum())} places"
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    bad = int((got.view(ints)[~ng] != want.view(ints)[~nw]).sum())
    return None if bad == 0 else f"{bad} of {got.numel()} values differ"


def _sync(torch, dev):
    if dev != "cpu":
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Timing:
    """Median seconds of one call: on the device (what the bandwidth is computed from) and on
    the host (Python and the launch, overlapped with the device's work in training).
    ``host_bound``: some call's host time outlasted the GPU sleep queued before it, so its
    device time may include a wait for the host."""

    device: float
    host: float
    host_bound: bool = False


_SLEEP_RATE: list = []  # torch.cuda._sleep's cycles per second, measured once


def _sleep_rate(torch) -> float:
    """Cycles per second of ``torch.cuda._sleep`` (the GPU clock it spins on), measured."""
    if not _SLEEP_RATE:
        n = 1 << 22
        for _ in range(2):  # the first call loads the kernel
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(n)
            b.record()
            b.synchronize()
        _SLEEP_RATE.append(n / (a.elapsed_time(b) / 1e3))
    return _SLEEP_RATE[0]


def _time(torch, dev, fn, iters: int) -> Timing:
    """Median times of ``fn()`` after two warm-up calls (compilation, caches).

    On CUDA each timed call is queued behind a GPU sleep longer than its host time, so the
    events around the call bracket the device's work alone. On an idle stream they would also
    count the host's time from the first event to the first launch: the Python wrapper's
    checks and the Triton launcher, tens of microseconds against kernels of 0.1-0.5 ms (the
    gpu_check runs of 2026-12-04 and 2026-12-06 timed that way)."""
    for _ in range(2):
        fn()
    _sync(torch, dev)
    if dev == "cpu":
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return Timing(statistics.median(times), statistics.median(times))
    t = time.perf_counter()
    fn()
    warm_host = time.perf_counter() - t
    torch.cuda.synchronize()
    hold = max(1e-3, 4 * warm_host)  # seconds of GPU sleep before each timed call
    cycles = int(hold * _sleep_rate(torch))
    times, host = [], []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        a.record()
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return Timing(statistics.median(times), statistics.median(host), max(host) >= hold)


def main() -> int:
    global _K
    args = _args()
    if args.json and _provenance.under_results(args.json):
        _provenance.record(Path(args.json).parent)
    if args.interpret:
        args.numel = min(args.numel, 1 << 16)
        args.check_numel = min(args.check_numel, 1 << 13)
        args.iters = min(args.iters, 1)
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("gpu_kernels_bench: no CUDA device here; nothing to benchmark "
              "(use --interpret for a CPU smoke test of this script).")
        return 0
    try:
        _K = _load(args.interpret)
    except Exception:
        traceback.print_exc()
        print("gpu_kernels_bench: could not import the kernels (is triton installed?)")
        return 1
    from fsdp_qcomm import QuantSpec, codec
    from fsdp_qcomm.codec import RngKey, torch_codec

    tiles = sys.modules["fsdp_qcomm.kernels._common"]
    if args.tile:
        if args.tile < 256 or args.tile & (args.tile - 1):
            print(f"--tile {args.tile}: must be a power of 2 >= 256")
            return 1
        tiles.TILE = tiles.GROUP_TILE = args.tile

    dev = "cpu" if args.interpret else "cuda"
    cases = [c for c in _cases(torch, QuantSpec, RngKey, torch_codec, codec)
             if args.only in c.name and not (args.no_diagnostics and c.diagnostic)]
    if dev == "cuda":
        free, total = torch.cuda.mem_get_info()
        # Largest case: x + ref + out (fp32) and an fp32 result, plus headroom.
        while args.numel > 1 << 20 and 5 * 4 * args.numel > free:
            args.numel //= 2
        print(f"device: {torch.cuda.get_device_name()}  free {free / 2**30:.1f} GiB  "
              f"triton {__import__('triton').__version__}  torch {torch.__version__}")
    rows = max(1, args.rows)
    n_big = max(8, args.numel // rows)
    print(f"timed input: {rows} x {n_big} = {rows * n_big / 2**20:.0f}M elements; "
          f"checks: 3 x {args.check_numel // 3 | 1} with NaN/Inf; tile {tiles.TILE}, "
          f"encoders' {tiles.GROUP_TILE}")

    # The device's copy bandwidth: read + write of the fp32 input.
    x = torch.randn(rows, n_big, device=dev)
    t_copy = _time(torch, dev, lambda x=x: x.clone(), args.iters).device
    bw_copy = 2 * x.numel() * 4 / t_copy
    print(f"torch.clone: {t_copy * 1e3:8.3f} ms  {bw_copy / 1e9:8.1f} GB/s (reference)")
    del x

    failures, slow, rows_out = [], [], []
    print(f"{'case':44s} {'check':>6s} {'ms':>9s} {'GB/s':>8s} {'x copy':>7s} {'host us':>8s}")
    n_chk = args.check_numel // 3 | 1  # odd: not a multiple of 8, 32 or any group
    for case in cases:
        status = "?"
        try:
            d = case.make(3, n_chk, dev, True)
            d_cpu = {k: (v.cpu().clone() if hasattr(v, "cpu") else v) for k, v in d.items()}
            diff = _same_bits(torch, case.run(_K, d), case.run(torch_codec, d_cpu))
            status = "ok" if diff is None else "FAIL"
            if diff is not None:
                failures.append(f"{case.name}: {diff}")
            del d, d_cpu
        except Exception as e:  # report it and go on with the other cases
            status = "ERROR"
            failures.append(f"{case.name}: check raised {type(e).__name__}: {e}")
            traceback.print_exc()
        row = {"case": case.name, "check": status}
        if case.diagnostic:
            row["diagnostic"] = dict(zip(("against", "leaves_out"), DIAGNOSTICS[case.name]))
        rows_out.append(row)
        if not case.timed:
            print(f"{case.name:44s} {status:>6s}", flush=True)
            continue
        try:
            d = case.make(rows, n_big, dev, False)
            out = case.run(_K, d)
            t = _time(torch, dev, lambda c=case, d=d: c.run(_K, d), args.iters)
            bw = case.moved(d, out) / t.device
            ratio = bw / bw_copy
            row.update(ms=t.device * 1e3, gbps=bw / 1e9, x_copy=ratio, host_us=t.host * 1e6,
                       host_bound=t.host_bound)
            if ratio < TARGET and not case.diagnostic:
                slow.append(f"{case.name}: {ratio:.2f}x")
            print(f"{case.name:44s} {status:>6s} {t.device * 1e3:9.3f} {bw / 1e9:8.1f} "
                  f"{ratio:7.2f} {t.host * 1e6:8.1f}"
                  + ("  (diagnostic)" if case.diagnostic else "" if ratio >= TARGET
                     else "  < target")
                  + ("  (host-bound)" if t.host_bound else ""), flush=True)
            del d, out
        except Exception as e:
            failures.append(f"{case.name}: timing raised {type(e).__name__}: {e}")
            traceback.print_exc()
            print(f"{case.name:44s} {status:>6s}  timing failed", flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()

    print(f"\n{len(cases) - len({f.split(':')[0] for f in failures})}/{len(cases)} cases exact "
          f"and timed; target >= {TARGET}x of copy bandwidth"
          + (" (timings are meaningless under --interpret)" if args.interpret else ""))
    for f in failures:
        print("  FAILED", f)
    for s in slow:
        print("  below target", s)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                       "interpret": args.interpret, "rows": rows, "numel": rows * n_big,
                       "clone_ms": t_copy * 1e3, "clone_gbps": bw_copy / 1e9, "target": TARGET,
                       "cases": rows_out, "failures": failures, "below_target": slow,
                       "tile": tiles.TILE, "group_tile": tiles.GROUP_TILE}, f,
                      indent=1)
    return 1 if failures or (args.strict and slow) else 0


if __name__ == "__main__":
    sys.exit(main())
