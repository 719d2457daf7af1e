"""What users would run instead, for the speed and bytes benchmarks: FSDP2 with bf16 parameters.

GPU users run FSDP2 under ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``
(torchtitan's default) or with ``reduce_dtype=bfloat16``: weight all-gathers in bf16, gradient
reduce-scatters in fp32 or bf16, and under HSDP the replica all-reduce in the reduce dtype. These
CPUs compute bf16 ~15x slower than fp32, so the benchmarks keep an fp32 model and reproduce the
wire instead: ``QCommConfig`` fields that send exactly the bytes FSDP2's own bf16 run hands its
process group, collective by collective (``tests/test_cast.py`` checks it against real
``MixedPrecisionPolicy`` runs), while computing in fp32. ``quantize_intra_node`` is on because
FSDP2 sends bf16 inside a node too; ``grad_overlap`` stays off because FSDP2's own reduction runs
in backward, on its stream.

``FSDP2_ROWS``: row label -> (the fields, or None for FSDP2's own fp32 collectives).
"""

from __future__ import annotations

from typing import Any, Optional

#: FSDP2 with bf16 parameters and fp32 reduction: bf16 gathers, FSDP2's own fp32 reductions
FSDP2_BF16_FP32: dict[str, Any] = dict(weight_scheme="bf16", quantize_intra_node=True,
                                       grad_overlap=False)
#: FSDP2 with bf16 parameters and bf16 reduction: bf16 gathers and bf16 reductions (the
#: emulation sums the bf16 rows in fp32; the bytes are a bf16 reduce-scatter's / all-reduce's)
FSDP2_BF16_BF16: dict[str, Any] = dict(weight_scheme="bf16", grad_scheme="bf16",
                                       quantize_intra_node=True, grad_overlap=False)

FSDP2_ROWS: dict[str, Optional[dict[str, Any]]] = {
    "FSDP2 fp32": None,
    "FSDP2 bf16/fp32": FSDP2_BF16_FP32,
    "FSDP2 bf16/bf16": FSDP2_BF16_BF16,
}

__all__ = ["FSDP2_BF16_BF16", "FSDP2_BF16_FP32", "FSDP2_ROWS"]
