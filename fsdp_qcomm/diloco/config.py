"""``DiLoCoConfig``: the schedule, the outer optimizer and the outer all-reduce's quantizer.

DiLoCo (Douillard et al., 2023): every replica group trains alone for ``sync_every`` (H) inner
steps, then the replicas average their pseudo-gradients (start-of-round weights minus current
weights) and an outer optimizer (SGD, Nesterov momentum 0.9, lr 0.7: the papers' defaults)
steps the start-of-round weights. Streaming DiLoCo (Douillard et al., 2025) cuts the model
into ``fragments`` (F) that sync in turn, one every H / F inner steps, so each fragment still
syncs every H steps; each fragment's all-reduce may overlap the next ``delay`` inner steps, and
the merged fragment is then ``delay`` inner steps stale (``alpha`` mixes the local weights of
those steps back in, as torchft's ``fragment_update_alpha``).

The outer all-reduce is ``collectives.replica_reduce.all_reduce_quantized`` at ``bits``
(2..8; None: an fp32 all-reduce), 32-point Hadamard rotation on by default, with optional error
feedback (``error_feedback``: each rank keeps the residual of its own encodings).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ..config import QuantSpec, Rounding, _check_choice, _check_int, _from_checked_dict

_OWNER = "DiLoCoConfig"


@dataclass(frozen=True)
class DiLoCoConfig:
    """One DiLoCo run's settings (validated on construction; errors name the field).

    sync_every: H, inner steps between two syncs of the same fragment (the outer step period).
    fragments: F, model fragments synced in turn (Streaming DiLoCo); a sync point every
        ``sync_every // fragments`` inner steps. ``sync_every`` must be a multiple of it.
    delay: inner steps a fragment's all-reduce runs behind (launched after inner step ``s``,
        merged after step ``s + delay``); ``0 <= delay < sync_every // fragments``.
    alpha: at a merge the fragment's weights become ``(1 - alpha) * new_global + alpha *
        local``: 0 drops the ``delay`` steps the all-reduce overlapped, 0.5 is Streaming
        DiLoCo's mixing.
    outer_lr / outer_momentum / outer_nesterov: the default outer optimizer,
        ``torch.optim.SGD`` over each fragment's start-of-round weights (pass
        ``outer_optimizer=`` to ``DiLoCo`` for another).
    bits: width of the outer all-reduce's codes (2..8), None for an unquantized fp32
        all-reduce. group_size / symmetric / rounding / scale_dtype: the rest of its
        ``QuantSpec``. hadamard: the 32-point rotation before quantizing (sums commute with it).
    error_feedback: keep each rank's quantization residual of the outer all-reduce and add it
        to the next one (fp32, about ``(1 + 1/R)`` times the rank's shard per fragment).
    overlap: run each all-reduce on a background thread (CPU process groups: a private copy
        of the replica group; CUDA: a side stream) while the ``delay`` inner steps run; None
        means ``delay > 0``. Same values either way.
    seed: keys the stochastic rounding (with the sync index, the rank and the fragment).
    init_sync: at construction, copy replica 0's weights to every replica (full precision,
        once) so that all start bit-identical (torchft replicas heal instead).
    diagnostics: measure what quantization does to each outer step (``DiLoCo.diagnostics()``):
        an extra fp32 all-reduce of the pseudo-gradient beside the quantized one, and the
        norms and cosine of the two means and of the applied update. For analysis runs: it
        sends the pseudo-gradient a second time, unquantized; training is unchanged.
    """

    sync_every: int = 32
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    bits: Optional[int] = 4
    group_size: int = 128
    symmetric: bool = True
    rounding: Rounding = "stochastic"
    scale_dtype: str = "float32"
    hadamard: bool = True
    error_feedback: bool = False
    overlap: Optional[bool] = None
    seed: int = 0
    init_sync: bool = True
    diagnostics: bool = False

    def __post_init__(self) -> None:
        _check_int(_OWNER, "sync_every", self.sync_every, 1)
        _check_int(_OWNER, "fragments", self.fragments, 1)
        if self.sync_every % self.fragments:
            raise ValueError(
                f"{_OWNER}.sync_every={self.sync_every} must be a multiple of "
                f"{_OWNER}.fragments={self.fragments}: each fragment syncs every sync_every "
                "inner steps, one fragment every sync_every // fragments steps"
            )
        _check_int(_OWNER, "delay", self.delay, 0)
        if self.delay >= self.period:
            raise ValueError(
                f"{_OWNER}.delay={self.delay} must be below sync_every // fragments = "
                f"{self.period}: a fragment's all-reduce must be merged before the next "
                "fragment's starts"
            )
        for name in ("alpha", "outer_lr", "outer_momentum"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{_OWNER}.{name} must be a number, got {v!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"{_OWNER}.alpha={self.alpha} must be in [0, 1]")
        if self.outer_lr <= 0:
            raise ValueError(f"{_OWNER}.outer_lr={self.outer_lr} must be > 0")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"{_OWNER}.outer_momentum={self.outer_momentum} must be in [0, 1)")
        for name in ("outer_nesterov", "symmetric", "hadamard", "error_feedback", "init_sync",
                     "diagnostics"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{_OWNER}.{name} must be a bool, got {getattr(self, name)!r}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"{_OWNER}.overlap must be a bool or None, got {self.overlap!r}")
        if self.overlap and self.delay == 0:
            raise ValueError(
                f"{_OWNER}.overlap=True needs delay >= 1 (the inner steps the all-reduce runs "
                "behind); with delay=0 it is merged at once, so there is nothing to overlap"
            )
        _check_int(_OWNER, "seed", self.seed, 0, 2**63 - 1)
        if self.bits is None:
            for name in ("hadamard", "error_feedback"):
                if getattr(self, name):
                    raise ValueError(
                        f"{_OWNER}.{name}=True needs a quantized outer all-reduce (bits 2..8); "
                        f"with bits=None set {name}=False"
                    )
            _check_choice(_OWNER, "rounding", self.rounding, ("nearest", "stochastic"))
            return
        try:
            self.spec()
        except ValueError as e:
            raise ValueError(str(e).replace("QuantSpec.", f"{_OWNER}.")) from None
        if self.outer_nesterov and self.outer_momentum == 0:
            raise ValueError(f"{_OWNER}.outer_nesterov=True needs outer_momentum > 0")

    @property
    def period(self) -> int:
        """Inner steps between two sync points (of consecutive fragments): H / F."""
        return self.sync_every // self.fragments

    @property
    def overlaps(self) -> bool:
        """``overlap`` resolved: on when ``delay > 0`` unless set False."""
        return self.delay > 0 if self.overlap is None else self.overlap

    @property
    def staleness(self) -> int:
        """Inner steps of local progress a merged fragment's new global weights do not hold
        (the ``delay`` steps its all-reduce ran behind); ``alpha`` mixes that much back in."""
        return self.delay

    def spec(self) -> Optional[QuantSpec]:
        """The outer all-reduce's quantizer (None: unquantized)."""
        if self.bits is None:
            return None
        return QuantSpec(bits=self.bits, group_size=self.group_size, symmetric=self.symmetric,
                         rounding=self.rounding, scale_dtype=self.scale_dtype)

    def wire_bits(self) -> float:
        """Bits per value the outer all-reduce sends, for large buffers (codes plus the
        per-group scale, and a minimum for min-max; Hadamard padding ignored); 32 for fp32."""
        spec = self.spec()
        if spec is None:
            return 32.0
        import torch

        scale = 8 * torch.empty((), dtype=spec.torch_scale_dtype).element_size()
        return spec.bits + scale * (1 if spec.symmetric else 2) / spec.group_size

    # ---- construction helpers -----------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DiLoCoConfig":
        """Build from a plain dict (TOML, CLI), rejecting unknown keys by name."""
        return _from_checked_dict(cls, values)

    def replace(self, **changes: Any) -> "DiLoCoConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    #: fields a checkpoint must match to resume (they fix the state's shapes and meaning)
    STATE_FIELDS = ("sync_every", "fragments", "delay", "bits", "group_size", "symmetric",
                    "scale_dtype", "hadamard", "error_feedback", "seed")


__all__ = ["DiLoCoConfig"]
