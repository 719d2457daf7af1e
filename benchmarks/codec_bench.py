"""Codec throughput against ``torch.clone`` of the same tensor on the same machine.

Times the public ``fsdp_qcomm.codec`` API on one fp32 tensor (default 64M elements = 256 MiB):
quantize and dequantize at 4 and 8 bits with nearest and stochastic rounding, and the fused
forms of the two-level gradient path (``reduce_requantize`` 8 -> 4 bits and
``reduce_dequantize``, each over ``--chunks`` wire blocks that together hold the same number of
elements). Throughput is GB/s of fp32 elements handled (4 * numel / time), so "ratio" is
clone time / codec time. Targets: quantize >= 0.25x clone on CPU, >= 0.7x on CUDA (there the
same API runs the Triton kernels; ``gpu_kernels_bench.py`` has the detailed GPU checks).

    python benchmarks/codec_bench.py [--numel N] [--reps R] [--device cpu|cuda]
        [--group-size G] [--chunks K] [--out results/codec_bench]

Each time is the median of ``--reps`` runs after one warm-up; the machine's load average is
printed with the table because shared CPUs make single runs noisy. ``--out DIR`` writes
``DIR/table.md``, the printed output to ``DIR/output.txt`` and the invocation to
``DIR/provenance.json`` (``_provenance``); ``--markdown FILE`` writes the table alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _provenance  # noqa: E402

from fsdp_qcomm import (
    QuantSpec,  # noqa: E402
    codec,  # noqa: E402
)
from fsdp_qcomm.codec import RngKey  # noqa: E402

CPU_TARGET, CUDA_TARGET = 0.25, 0.7


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=64 * 1024 * 1024, help="fp32 elements (64M)")
    p.add_argument("--reps", type=int, default=5, help="timed runs per case (median reported)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--chunks", type=int, default=4, help="wire blocks summed by the fused forms")
    p.add_argument("--markdown", default="", help="also write the table to this .md file")
    p.add_argument("--out", default="",
                   help="write table.md, output.txt and provenance.json to this folder")
    return p.parse_args()


def _timer(device: torch.device, reps: int):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(fn) -> float:
        fn()  # warm-up: first-call allocations, kernel compilation
        ts = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    return run


def main() -> int:
    a = _args()
    if a.out:
        a.markdown = a.markdown or str(Path(a.out) / "table.md")
        _provenance.record(a.out)
        _provenance.tee_stdout(Path(a.out) / "output.txt")
    elif a.markdown and _provenance.under_results(a.markdown):
        _provenance.record(Path(a.markdown).parent)
    dev = torch.device(a.device)
    timed = _timer(dev, a.reps)
    n, k = a.numel, a.chunks
    gb = 4 * n / 1e9
    x = torch.randn(1, n, device=dev)
    key = RngKey(seed=1, step=2, rank=3, bucket=4)
    target = CUDA_TARGET if dev.type == "cuda" else CPU_TARGET
    t_clone = timed(lambda: x.clone())
    rows = [("torch.clone", gb / t_clone, 1.0, "")]

    def add(name, t, is_quant=False):
        ratio = t_clone / t
        mark = ("ok" if ratio >= target else "below") if is_quant else ""
        rows.append((name, gb / t, ratio, mark))
        print(f"{name:42s} {gb / t:8.3f} GB/s  {ratio:6.3f}x {mark}", flush=True)

    print(f"device {dev}, numel {n}, threads {torch.get_num_threads()}, "
          f"clone {gb / t_clone:.3f} GB/s", flush=True)
    for bits in (4, 8):
        for rounding in ("nearest", "stochastic"):
            spec = QuantSpec(bits=bits, group_size=a.group_size, rounding=rounding)
            add(f"quantize {bits}-bit {rounding}", timed(lambda: codec.quantize(x, spec, key)),
                True)
            data = codec.quantize(x, spec, key)
            add(f"dequantize {bits}-bit {rounding}",
                timed(lambda d=data: codec.dequantize(d, n, spec)))
            del data
    m = n // k
    s8 = QuantSpec(bits=8, group_size=a.group_size)
    s4 = QuantSpec(bits=4, group_size=a.group_size)
    chunks = torch.stack([codec.quantize(x[:, j * m:(j + 1) * m], s8, key._replace(rank=j))
                          for j in range(k)])
    gbk = 4 * k * m / 1e9
    t = timed(lambda: codec.reduce_requantize(chunks, m, s8, s4, key))
    add(f"reduce_requantize {k}x8-bit -> 4-bit", t * gb / gbk)
    c4 = torch.stack([codec.quantize(x[:, j * m:(j + 1) * m], s4, key._replace(rank=j))
                      for j in range(k)])
    t = timed(lambda: codec.reduce_dequantize(c4, m, s4))
    add(f"reduce_dequantize {k}x4-bit", t * gb / gbk)
    load = "/".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"load average (1/5/15 min): {load}")
    if a.markdown:
        path = Path(a.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [
            f"Device {dev}, {n} fp32 elements, group size {a.group_size}, "
            f"{torch.get_num_threads()} threads, median of {a.reps}, load average {load}.",
            f"GB/s of fp32 elements; ratio = clone time / op time; quantize target {target}x.",
            "", "| op | GB/s | x clone | target |", "|---|---:|---:|---|",
        ]
        lines += [f"| {r[0]} | {r[1]:.3f} | {r[2]:.3f} | {r[3]} |" for r in rows]
        path.write_text("\n".join(lines) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
