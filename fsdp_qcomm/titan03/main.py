"""The CPU debug job on torchtitan 0.3: ``python -m fsdp_qcomm.titan03.main [--scheme sdp4bit]
[--replicas 2] [--steps 300] [-- torchtitan flags]``.

Builds the offline data once, runs ``torchrun --standalone --nproc_per_node 4 -m
torchtitan.train --module fsdp_qcomm.titan03 --config debug_<scheme>`` with one thread per
rank (rank 0's log: loss and the ``qcomm:`` line every 10 steps, held-out loss every 100), then
prints the summary: loss first -> last, held-out losses, bytes sent per step against unquantized
FSDP2. ``--replicas 2`` runs HSDP: 2 replicas x 2 shards
(``--parallelism.data_parallel_replicate_degree 2``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_qcomm.titan_common.launch import (
    debug_job_args,
    default_dump,
    loss_rank,
    run_debug_job,
    torchrun_prefix,
)
from fsdp_qcomm.titan_common.shapes import DEBUG_VOCAB_SIZE

MODULE = "fsdp_qcomm.titan03"


def torchrun_command(
    config: str, nproc: int, dump: Path, extra: list[str], *, steps: int | None = None,
    replicas: int = 1, all_ranks: bool = False,
) -> list[str]:
    cmd = torchrun_prefix(nproc, dump, all_ranks, loss_rank(nproc, extra)) + [
        "-m", "torchtitan.train", "--module", MODULE, "--config", config,
        "--dump_folder", str(dump)]
    if steps is not None:
        cmd += ["--training.steps", str(steps)]
    if replicas > 1:
        cmd += ["--parallelism.data_parallel_replicate_degree", str(replicas)]
    return cmd + extra


def main(argv: list[str] | None = None) -> int:
    def add(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--config", default=None, help="a recipe function of "
                        "fsdp_qcomm.titan03 (default: debug_<scheme>)")
        ap.add_argument("--replicas", type=int, default=1,
                        help="HSDP replicas (data_parallel_replicate_degree); default 1: FSDP")

    args, extra = debug_job_args(argv, __doc__, add)
    config = args.config or f"debug_{args.scheme}"
    suffix = f"_{args.replicas}x{args.nproc // args.replicas}" if args.replicas > 1 else ""
    dump = args.out.resolve() if args.out else default_dump(f"titan03_{config}{suffix}")
    cmd = torchrun_command(config, args.nproc, dump, extra, steps=args.steps,
                           replicas=args.replicas, all_ranks=args.all_ranks)
    return run_debug_job(cmd, dump, DEBUG_VOCAB_SIZE)


if __name__ == "__main__":
    sys.exit(main())
