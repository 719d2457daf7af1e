"""FSDP2's reduce-scatter replaced by the quantized one (``collectives.grad_reduce``).

FSDP2 hands its reduce-scatter hook the flat gradient buffer ``input_tensor`` (``world * m``
values in ``reduce_dtype``, or in the gradients' own 16-bit dtype where the hook's ``allocate``
kept it, ``_input_dtype``; row ``j`` of ``input_tensor.view(world, m)`` belongs to rank ``j``),
the output shard, the shard process group and the reduce op: ``AVG`` by default, ``SUM`` after
``set_force_sum_reduction_for_comms(True)``, ``PREMUL_SUM(1 / factor)`` after
``set_gradient_divide_factor(factor)`` (all three are handled, gloo included). FSDP ignores the
hook's return value, so the call finishes before returning, except with
``QCommConfig.grad_overlap`` on CPU, where it may finish on a background thread before
``backward()`` returns (``grad_overlap``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from ..codec import FLOAT_DTYPES, RngKey
from ..collectives.cast import reduce_scatter_cast
from ..collectives.error_feedback import Feedback, FeedbackState
from ..collectives.grad_reduce import (
    feedback_shapes,
    reduce_scatter_plain,
    reduce_scatter_quantized,
)
from ..collectives.level_sync import LevelSync
from ..collectives.topology import Topology, node_topology, private_group
from ..config import QCommConfig
from ..stats import CommStats
from . import internals as fsdp
from .grad_overlap import ReductionQueue, defer_reason
from .internals import ReduceScatter
from .residual_state import ScaleSource, call_feedback
from .tp_peers import PeerSync

#: the gradient schemes whose reductions read their input as float32 values (the codec, or
#: the bf16 cast), whatever its float dtype: everything but FSDP's own reduce-scatter
_READS_INPUT_AS_FP32 = ("one_level", "two_level", "bf16")


def _input_dtype(grads: Optional[torch.dtype]) -> torch.dtype:
    """The dtype of a reduce-scatter input FSDP asks for in float32 (``reduce_dtype``): the
    gradients' own, when they are 16-bit floats. FSDP's copy-in would widen them exactly and the
    reduction would read the same values back, so the input holds the same values in half the
    bytes: with bf16 parameters and fp32 reduction the copy-in writes 2 bytes per gradient
    value instead of 4 and the encoder reads 2 instead of 4, the same bits on the wire and in
    the reduced shard. float32 otherwise, or when FSDP's frame does not say
    (``internals.reduce_allocation``)."""
    return grads if grads in (torch.bfloat16, torch.float16) else torch.float32


@dataclass(frozen=True)
class PreparedGroup:
    """A process group a hook will be handed, with its node topology (and subgroups) created by
    ``enable`` up front: creating process groups inside backward risks a hang on NCCL."""

    group: ProcessGroup
    topology: Topology


class QuantizedReduceScatter(ReduceScatter):
    """The reduce-scatter of one FSDP module, with quantized gradients, bf16 rows summed in fp32
    (``grad_scheme="bf16"``), or, with ``grad_scheme="none"`` and ``grad_overlap``, FSDP's
    unquantized reduction moved to the background thread: the reference that shows the gain of
    quantization alone.

    ``bucket`` (the module's index) and a per-instance call counter key the stochastic
    rounding: call ``i`` of bucket ``b`` on global rank ``r`` uses
    ``RngKey(config.seed, i, r, b)``, so the same run twice sends the same bits. ``call_count``
    is public so a resumed run can restore it. With ``grad_levels="learned"`` a ``LevelSync``
    refits the gradient level table from all ranks' gradients every ``levels_refresh_every``
    calls (``call_count`` is its step). ``param_group``: the module's FSDP param group, which
    ``grad_overlap`` inspects to decide whether a reduction may finish after the call.
    ``prepared`` / ``prepared_overlap``: FSDP's reduce-scatter group and ``grad_overlap``'s private
    copy of it, with their topologies (from ``enable``); without them the topology and the
    private group are created on first use.

    ``feedback``: the error-feedback residuals (``grad_error_feedback``), kept in the module's
    full layout and mapped into each call's (``residual_state``); ``grad_scale``: the loss
    scaler's scale, set by ``QCommHandle.attach_grad_scaler``.
    """

    def __init__(
        self, config: QCommConfig, stats: CommStats, bucket: int, param_group: Optional[Any] = None,
        *, prepared: Optional[PreparedGroup] = None,
        prepared_overlap: Optional[PreparedGroup] = None,
        queue: Optional[ReductionQueue] = None, name: str = "",
    ) -> None:
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 0:
            raise ValueError(f"bucket must be a non-negative int (module index), got {bucket!r}")
        self.config = config
        self.stats = stats
        self.bucket = bucket
        self.name = name or f"bucket {bucket}"
        self.param_group = param_group
        self.prepared = prepared
        self.prepared_overlap = prepared_overlap
        if config.grad_overlap and queue is None:
            queue = ReductionQueue()
        self.queue = queue  # grad_overlap: the enable call's reduction thread
        # HSDP: the module's replica all-reduce hook; checked at every call, before FSDP runs
        # its all-reduce, so a hook replaced after ``enable`` stops the backward on every rank
        self.replica: Optional[Any] = None
        self.call_count = 0
        self.feedback = (FeedbackState(config.grad_error_feedback_decay)
                         if config.grad_error_feedback != "none" else None)
        self.grad_scale: Optional[ScaleSource] = None
        # FSDP x TP: averages the TP-replicated parameters' reduced gradients over their TP
        # peers after the reduction (``tp_peers``; under HSDP the replica hook does it)
        self.peer_sync: Optional[PeerSync] = None
        self.levels = None
        if config.grad_levels == "learned":
            self.levels = LevelSync(config.grad_inter_spec(), config.levels_refresh_every)
        self._narrowed: Optional[weakref.ref] = None  # the last input ``allocate`` narrowed

    def allocate(
        self, size: Sequence[Union[int, torch.SymInt]], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """FSDP's buffers; the input in the gradients' own 16-bit dtype where FSDP asks for
        float32 (``_input_dtype``)."""
        asked = dtype
        if dtype == torch.float32 and self.config.grad_scheme in _READS_INPUT_AS_FP32:
            from_fsdp, grads = fsdp.reduce_allocation()
            if not from_fsdp:
                self.stats.note("reduce-scatter: allocate() was not called from FSDP's "
                                f"foreach_reduce (torch {torch.__version__}), so gradient "
                                "inputs stay float32 (2 more bytes per value copied and read)")
            dtype = _input_dtype(grads)
        buf = torch.empty(*size, dtype=dtype, device=device)
        if dtype != asked:
            self._narrowed = weakref.ref(buf)
        return buf

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        op: Union[ReduceOp, "ReduceOp.RedOpType"],
        async_op: bool = False,
    ) -> None:
        if self.replica is not None:
            self.replica.check_installed()
        if self._narrowed is not None and self._narrowed() is output_tensor:
            # every rank's FSDP took the same path here, so every rank raises
            raise fsdp.changed("foreach_reduce handed the reduce-scatter hook, as its output, "
                               "the buffer it allocated first (fsdp_qcomm allocates that one "
                               "as the input, in the gradients' 16-bit dtype)")
        if self.param_group is not None:
            op = fsdp.readable_reduce_op(op, self.param_group)
        if input_tensor.dtype not in FLOAT_DTYPES:
            # float64 gradients, as the weight gather does for such dtypes: a plain collective
            if self.config.grad_scheme != "none":
                self.stats.note(
                    f"{self.name}: gradient reduce-scatter fell back to a plain one "
                    f"(grad_scheme={self.config.grad_scheme!r} not applied): the gradients are "
                    f"{input_tensor.dtype}, the codec takes {', '.join(map(str, FLOAT_DTYPES))}")
            reduce_scatter_plain(output_tensor, input_tensor, group, op=op, stats=self.stats,
                                 topology=self._prepared_topology(group))
            if self.peer_sync is not None:
                self.peer_sync(output_tensor, self.stats)
            return None
        key = RngKey(self.config.seed, self.call_count, dist.get_rank(), self.bucket)
        levels = None
        if self.levels is not None and group.size() > 1:
            # rows as they are encoded: one per destination rank
            rows = input_tensor.reshape(group.size(), -1)
            levels = self.levels.table(rows, group, self.call_count, self.stats)
        self.call_count += 1
        topology = self._prepared_topology(group)
        feedback = None
        if self.config.grad_scheme not in ("none", "bf16") and group.size() > 1:
            feedback = call_feedback(self.feedback, self.param_group,
                                     input_tensor.numel() // group.size(), self.stats,
                                     self.grad_scale, "reduce-scatter")
        hsdp = self.param_group is not None and fsdp.is_hsdp(self.param_group)
        if self.config.grad_overlap and group.size() > 1 and not hsdp:
            # Always on the private group, deferred or not (``ReductionQueue.submit``).
            if self.prepared_overlap is not None:
                own, own_topology = self.prepared_overlap.group, self.prepared_overlap.topology
            else:  # created here, on the main thread, in the same order on every rank
                own, own_topology = private_group(group), None
                if self.config.grad_scheme == "two_level":
                    own_topology = node_topology(own, self.config.ranks_per_node)
            why = defer_reason(self.param_group, output_tensor, op)
            if self.peer_sync is not None:
                why = why or "TP-replicated gradients are averaged over TP peers right after"
            if why:
                self.stats.note(f"grad_overlap: a reduce-scatter finished inside its call: {why}")
            self.queue.submit(partial(self._reduce, output_tensor, input_tensor, own, op, key,
                                      levels, own_topology, feedback), defer=not why)
            if self.peer_sync is not None:
                self.peer_sync(output_tensor, self.stats)
            return None
        # Under HSDP this hop is never the deferred one (FSDP all-reduces its output at once):
        # it runs here, on FSDP's own group inside the node, while the queue runs the earlier
        # modules' replica all-reduces on groups of their own (a structural decision, the same
        # on every rank, so no rank routes it differently). Through the queue it waited for
        # all of them first: the two threads took turns (results/step_profile).
        self._reduce(output_tensor, input_tensor, group, op, key, levels, topology, feedback)
        if self.peer_sync is not None:  # set here only when no replica hook runs it after
            self.peer_sync(output_tensor, self.stats)
        return None

    def _reduce(self, output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, op: Any,
                key: RngKey, levels: Optional[torch.Tensor], topology: Optional[Topology],
                feedback: Feedback = None) -> None:
        if self.config.grad_scheme == "none":
            reduce_scatter_plain(output, input, group, op=op, stats=self.stats, topology=topology)
            return
        if self.config.grad_scheme == "bf16":
            reduce_scatter_cast(output, input, group, op=op, stats=self.stats, topology=topology)
            return
        reduce_scatter_quantized(output, input, group, self.config, key, op=op,
                                 stats=self.stats, levels=levels, topology=topology,
                                 feedback=feedback)

    def feedback_shapes(self, m: int) -> dict[str, tuple[int, ...]]:
        """The error-feedback residuals a call with ``m`` output values keeps (checkpoint
        templates need them before the first step)."""
        if self.feedback is None or self.prepared is None:
            return {}
        group = self.prepared.group
        return feedback_shapes(self.config, group.size(), m, self.prepared.topology.layout)

    def _prepared_topology(self, group: ProcessGroup) -> Optional[Topology]:
        if self.prepared is None:
            return None
        if group is not self.prepared.group:
            raise RuntimeError(
                f"FSDP handed reduce-scatter bucket {self.bucket} a process group other than the "
                "one fsdp_qcomm.enable() prepared (was set_separate_reduce_scatter_group called "
                "after enable?). Change FSDP's groups before enable(), or disable and enable again"
            )
        return self.prepared.topology


__all__ = ["PreparedGroup", "QuantizedReduceScatter"]
