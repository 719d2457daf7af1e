"""Single-process CPU cost of the sdp4bit hook path, stage by stage (no process group).

Emulates what one of 4 ranks (2 nodes x 2) computes per step for a ~10.9M-parameter fp32 model:
qWD weight gather (encode the shard's difference segment by segment, decode and accumulate all
4 ranks' rows) and the TLq-HS gradient reduce-scatter (Hadamard + 8-bit quantize of 4 rows, sum
and 4-bit re-quantize of the 2 received intra-node rows, sum and inverse Hadamard of the 2
inter-node rows). The wire buffers a real run would receive are stood in for by this rank's own.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/hook_profile.py [--profile]
        [--out results/hook_profile]

``--out DIR`` also writes the printed output to ``DIR/output.txt`` and the invocation to
``DIR/provenance.json`` (``_provenance``).
"""

from __future__ import annotations

import argparse
import time

import _provenance
import torch

from fsdp_qcomm import codec
from fsdp_qcomm.codec import RngKey
from fsdp_qcomm.collectives.weight_gather import decode_shards, encode_shard
from fsdp_qcomm.config import QCommConfig


def _segments(total: int, count: int, gen: torch.Generator) -> list[int]:
    cuts = sorted(torch.randint(1, total, (count - 1,), generator=gen).tolist())
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges, edges[1:])]


def _time(fn, reps: int) -> float:
    """Best of ``reps`` runs (after one warm-up): the machine is shared, the minimum is stable."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=10_870_000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--segments", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="", help="folder for output.txt and provenance.json")
    args = ap.parse_args()
    if args.out:
        _provenance.record(args.out)
        _provenance.tee_stdout(f"{args.out}/output.txt")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    cfg = QCommConfig.preset("sdp4bit")
    wspec, s1, s2 = cfg.weight_spec(), cfg.grad_intra_spec(), cfg.grad_inter_spec()
    world = args.world
    n = -(-args.params // world)
    segs = _segments(n, args.segments, gen)
    key = RngKey(0, 1, 0, 0)

    x = torch.randn(n)
    ref = x + 1e-3 * torch.randn(n)
    wire = encode_shard(x, segs, wspec, key, ref=ref)
    gathered = wire.repeat(world, 1)
    full_ref = torch.zeros(world, n)

    g = torch.randn(world, n)
    hl = codec.hadamard_len(n)
    w1 = codec.quantize(g, s1, key, hadamard=True)            # [4, W1]
    recv1 = w1[:2].unsqueeze(1).expand(2, 2, -1).contiguous()  # [local src, nodes, W1]
    w2 = codec.reduce_requantize(recv1, hl, s1, s2, key)       # [2, W2]

    stages = {
        "qwd encode_shard": lambda: encode_shard(x, segs, wspec, key, ref=ref),
        "qwd decode_shards": lambda: decode_shards(
            gathered, segs, wspec, full_ref, accumulate=True
        ),
        "grad quantize(H, 8b)": lambda: codec.quantize(g, s1, key, hadamard=True),
        "grad reduce_requantize": lambda: codec.reduce_requantize(recv1, hl, s1, s2, key),
        "grad reduce_dequantize(H)": lambda: codec.reduce_dequantize(w2, n, s2, hadamard=True),
        "hadamard32 [4, n]": lambda: codec.torch_codec.hadamard32(g[:, :hl - 32 if hl > n else hl]),
    }
    total = 0.0
    for name, fn in stages.items():
        t = _time(fn, args.reps)
        if not name.startswith("hadamard"):
            total += t
        print(f"{name:28s} {t * 1e3:8.1f} ms")
    print(f"{'total per step':28s} {total * 1e3:8.1f} ms  (shard {n}, {len(segs)} segments, "
          f"threads {torch.get_num_threads()})")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for name, fn in stages.items():
                if not name.startswith("hadamard"):
                    fn()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
