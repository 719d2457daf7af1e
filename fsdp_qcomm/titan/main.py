"""The CPU debug job: ``python -m fsdp_qcomm.titan.main [--scheme sdp4bit] [--steps 300] ...``.

1. builds the offline corpus and tokenizer (cached; see ``titan_common/data.py``) in this
   process, so the ranks do not all wait on the build lock;
2. runs ``torchrun --standalone --nproc_per_node 4 -m torchtitan.train`` on
   ``recipes/debug_<scheme>.toml`` (stock torchtitan 0.2.2 entry point; our code comes in
   through ``custom_import``), one thread per rank, printing rank 0's log (loss every 10 steps);
3. reads ``<dump_folder>/qcomm_summary.json`` and prints a summary: loss first -> last,
   held-out loss, and bytes sent per step against unquantized FSDP2.

Arguments after ``--`` go to torchtitan, e.g. ``-- --qcomm.weight_bits 8``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_qcomm.titan.recipes import RECIPES_DIR
from fsdp_qcomm.titan_common.launch import (
    debug_job_args,
    default_dump,
    loss_rank,
    run_debug_job,
    torchrun_prefix,
)
from fsdp_qcomm.titan_common.shapes import DEBUG_VOCAB_SIZE


def torchrun_command(
    recipe: Path, nproc: int, steps: int | None, dump: Path, extra: list[str],
    all_ranks: bool = False,
) -> list[str]:
    cmd = torchrun_prefix(nproc, dump, all_ranks, loss_rank(nproc, extra)) + [
        "-m", "torchtitan.train", "--job.config_file", str(recipe),
        "--job.dump_folder", str(dump)]
    if steps is not None:
        cmd += ["--training.steps", str(steps)]
    return cmd + extra


def main(argv: list[str] | None = None) -> int:
    def add(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--recipe", type=Path, default=None,
                        help="a TOML recipe (default: recipes/debug_<scheme>.toml)")

    args, extra = debug_job_args(argv, __doc__, add)
    recipe = args.recipe or RECIPES_DIR / f"debug_{args.scheme}.toml"
    if not recipe.is_file():
        print(f"fsdp_qcomm.titan.main: no recipe at {recipe}. The debug recipes are TOML files "
              "in a checkout of fsdp-qcomm (recipes/), which an installed package does not "
              "carry: run from a clone of the repository, or pass --recipe PATH.",
              file=sys.stderr)
        return 2
    dump = args.out.resolve() if args.out else default_dump(f"debug_{args.scheme}")
    cmd = torchrun_command(recipe, args.nproc, args.steps, dump, extra, args.all_ranks)
    return run_debug_job(cmd, dump, DEBUG_VOCAB_SIZE)


if __name__ == "__main__":
    sys.exit(main())
