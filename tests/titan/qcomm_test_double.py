"""TEST DOUBLE (tests only): stands in for ``fsdp_qcomm.enable`` to test the titan wiring.

Loaded with ``--experimental.custom_import qcomm_test_double`` (``tests/titan`` on PYTHONPATH).
It imports the real plug-in, then replaces ``register._install_qcomm`` with a function that
installs *unquantized* custom collectives on every FSDP module: real gloo all-gathers and
reduce-scatters that count the bytes each rank sends and receives. That lets the tests check,
without the library, that (1) the parallelize wrapper installs hooks and FSDP calls them, and
(2) the metrics pipeline reports exactly ratio 1.0 / 32 bits per element for a plain fp32
exchange, i.e. that the unquantized reference in ``comm_stats`` counts what FSDP sends, and
(3) FSDP hands the reduce-scatter ``ReduceOp.SUM``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from fsdp_qcomm.titan import register


def _new_counts() -> dict:
    return {
        "all_gather": {"bytes_sent": 0, "bytes_received": 0, "calls": 0},
        "reduce_scatter": {"bytes_sent": 0, "bytes_received": 0, "calls": 0},
    }


class CountingAllGather(AllGather):
    def __init__(self, counts: dict) -> None:
        self.counts = counts["all_gather"]

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        w = group.size()
        nbytes = input_tensor.numel() * input_tensor.element_size()
        self.counts["bytes_sent"] += (w - 1) * nbytes
        self.counts["bytes_received"] += (w - 1) * nbytes
        self.counts["calls"] += 1
        dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
        return None  # blocking call done: FSDP waits on nothing


class CountingReduceScatter(ReduceScatter):
    def __init__(self, counts: dict) -> None:
        self.counts = counts["reduce_scatter"]

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        # The plug-in forces FSDP's sum reduction (gloo rejects PREMUL_SUM); torchtitan has
        # already divided the loss by the global token count, so a hook must SUM, not average.
        if not op == dist.ReduceOp.SUM:
            raise AssertionError(f"expected ReduceOp.SUM from FSDP, got {op!r}")
        w = group.size()
        nbytes = output_tensor.numel() * output_tensor.element_size()
        self.counts["bytes_sent"] += (w - 1) * nbytes
        self.counts["bytes_received"] += (w - 1) * nbytes
        self.counts["calls"] += 1
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
        return None


class CountingHandle:
    def __init__(self, model: torch.nn.Module) -> None:
        self.counts = _new_counts()
        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        ag, rs = CountingAllGather(self.counts), CountingReduceScatter(self.counts)
        for m in self.modules:
            m.set_custom_all_gather(ag)
            m.set_custom_reduce_scatter(rs)

    def stats(self) -> dict:
        return copy.deepcopy(self.counts)


def _install_counting(model_parts, qcomm_cfg):
    return [CountingHandle(part) for part in model_parts]


register._install_qcomm = _install_counting
