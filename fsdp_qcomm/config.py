"""Configuration: what to quantize, how, and with which wire format.

`QuantSpec` describes one quantizer (one wire format); `QCommConfig` says which quantizer each
collective uses. Both validate on construction so that a bad value fails at ``enable`` time with
a message naming the field, never later inside a collective.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional

import torch

Rounding = Literal["nearest", "stochastic"]
WeightScheme = Literal["none", "bf16", "direct", "qwd"]
GradScheme = Literal["none", "bf16", "one_level", "two_level"]
ErrorFeedback = Literal["none", "inter", "all"]
Levels = Literal["uniform", "learned"]
Reference = Literal["node", "full"]
_QSDP_STRING = re.compile(r"^W(\d+)G(\d+)(?:[-:_](uniform|learned))?$", re.IGNORECASE)

_SCALE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _from_checked_dict(cls: type, values: dict[str, Any]) -> Any:
    """``cls(**values)`` for a config dataclass, naming unknown keys (TOML, CLI) first."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown {cls.__name__} field(s) {unknown}; known fields: {', '.join(sorted(known))}"
        )
    return cls(**values)


def _check_choice(owner: str, name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(
            f"{owner}.{name}={value!r} is not valid; allowed values: "
            + ", ".join(repr(a) for a in allowed)
        )


def _check_int(owner: str, name: str, value: Any, lo: int, hi: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{owner}.{name}={value} is out of range; it must be {rng}")


@dataclass(frozen=True)
class QuantSpec:
    """One quantizer, which fixes one wire format.

    bits: code width, 2..8. Codes are packed densely (see ``fsdp_qcomm.codec.wire``).
    group_size: elements sharing one scale; a multiple of 8 so every group's codes fill whole
        bytes. Tensors of any length are accepted (the last group may be partial).
    symmetric: True = absmax scaling with levels -(2^(b-1)-1)..2^(b-1)-1 (SDP4Bit);
        False = min-max (asymmetric) scaling with levels 0..2^b-1 (QSDP / CGX).
    rounding: "nearest" (floor(x/s + 1/2)) or "stochastic" (floor(x/s + u), u ~ U[0,1) from a
        counter-based RNG, so unbiased and reproducible).
    scale_dtype: dtype of the per-group scale (and minimum) on the wire. A float16 scale
        below 2^-14 (6.1e-5) is subnormal and below 2^-25 (3e-8) rounds to zero, so a group
        whose range is under ``qmax`` x 3e-8 decodes as a constant; bfloat16 spends the same
        2 bytes with float32's range. An asymmetric group's minimum is stored rounded down, so
        a 16-bit one widens the range its codes span by up to one spacing of |min| (bfloat16:
        up to 2^-7 of it): a group far from zero and tight around it gets coarser steps.
    """

    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    rounding: Rounding = "stochastic"
    scale_dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_int("QuantSpec", "bits", self.bits, 2, 8)
        _check_int("QuantSpec", "group_size", self.group_size, 8)
        if self.group_size % 8:
            raise ValueError(
                f"QuantSpec.group_size={self.group_size} must be a multiple of 8 so each group's "
                f"codes fill whole bytes; use {self.group_size + 8 - self.group_size % 8}"
            )
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"QuantSpec.symmetric must be a bool, got {self.symmetric!r}")
        _check_choice("QuantSpec", "rounding", self.rounding, ("nearest", "stochastic"))
        _check_choice("QuantSpec", "scale_dtype", self.scale_dtype, tuple(_SCALE_DTYPES))

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return _SCALE_DTYPES[self.scale_dtype]

    @property
    def qmax(self) -> int:
        """Largest code magnitude: 2^(b-1)-1 for symmetric, 2^b-1 for asymmetric."""
        return (1 << (self.bits - 1)) - 1 if self.symmetric else (1 << self.bits) - 1


@dataclass(frozen=True)
class QCommConfig:
    """Which quantizer each FSDP2 collective uses.

    Weights (the all-gather): ``weight_scheme`` "none" (plain gather through our hook),
    "bf16" (the shard rounded to bfloat16 on the wire, every rank computing with the same
    rounded weights: ``collectives.cast``), "direct" (quantize the weights themselves: QSDP,
    ZeRO++ qwZ, the qW ablation) or "qwd" (SDP4Bit: quantize the difference against a
    reference every rank holds).
    ``weight_hadamard`` rotates what is sent (weights or differences) by the 32-point Hadamard
    transform first, as TLq-HS does for gradients; ``weight_levels="learned"`` encodes it on a
    fitted level table instead (QSDP; for qWD the table is fitted to the differences).

    Gradients (the reduce-scatter): ``grad_scheme`` "none", "bf16" (rows rounded to bfloat16,
    one all-to-all, summed in fp32 by the receiver; HSDP's replica all-reduce alike),
    "one_level" (quantize once, one all-to-all, ``grad_inter_bits``) or "two_level"
    (``grad_intra_bits`` inside a node, then ``grad_inter_bits`` across nodes).
    ``grad_hadamard`` adds the 32-point Hadamard smoothing. The bit widths, group sizes and
    rounding fields apply to the quantized schemes, not to "bf16".

    ``grad_overlap`` (CPU process groups): run each module's gradient reduction on a background
    thread so it overlaps the rest of backward, as FSDP's reduce-scatter stream does on GPUs;
    ``backward()`` returns once all reductions finished. Same bytes and values. Under HSDP the
    all-reduce across replicas is the part that runs there. With ``grad_scheme="none"`` the
    reductions stay unquantized but run on that thread too: the reference point that isolates
    what quantization gains.

    ``grad_error_feedback`` (``collectives.error_feedback``): keep each rank's quantization
    residual of the gradient hops and add it to the next step's values: "inter" at the hops
    whose bytes cross nodes (hop 2 of two levels, HSDP's all-reduce across replicas, a single
    hop over several nodes), "all" at every quantized gradient hop, "none" off. Costs fp32
    memory per rank (``handle.stats()["summary"]["error_feedback_bytes"]``, ``docs/``).
    ``grad_error_feedback_decay`` (in (0, 1], default 1: classic error feedback): keep that
    fraction of each step's residual and drop the rest, which trades part of the bias
    correction for less per-step noise (what AdamW's second moment takes in; ``docs/lowbit.md``).

    ``weight_reuse_unchanged``: a forward weight gather whose weights nothing changed since the
    module's previous gather (no optimizer step, no other write: gradient-accumulation
    micro-batches, evaluation between steps) sends nothing and reuses the weights that gather
    delivered (what changed is decided the same on every rank: ``fsdp.change_tracker``).
    ``None`` (default): on for qWD, whose reference is kept anyway, off for "direct" and "none",
    where it keeps one unsharded copy of each module's parameters (in the all-gather dtype) plus
    one shard per rank alive between gathers (``handle.reference_bytes()``). ``False`` under
    qWD: every forward gather exchanges a quantized difference, changed or not. Without reuse,
    direct schemes re-send the same bytes (they reuse the RNG key, so the weights are the same
    either way). Backward re-gathers always compute with the weights their forward used.

    ``verify_weight_writes`` (gathers that may reuse weights: qWD, direct schemes, kept
    weights): before each forward, every rank digests its shards and the ranks agree on what
    changed since the previous gather (``fsdp.change_tracker``: one all-gather of 8 bytes per
    module and, on CUDA, one host read per forward), so writes through ``p.data`` reach the next
    forward and a write on some ranks only raises on every rank. ``False`` decides from this
    rank's own optimizer hooks and version counters with no collective and no host read: writes
    through ``p.data``, and an optimizer's writes to parameters without a gradient (which
    ``torch.optim`` never makes), are then missed until ``handle.mark_changed()``, and a write on
    some ranks only hangs the group instead of raising.

    ``weight_reference`` (qWD): "node" keeps on each rank only the reference of the shards of
    the ranks with its local index on every node (``1/ranks_per_node`` of the model: ZeRO++'s
    hpZ partitioning): a gather sends the quantized differences across nodes among those ranks,
    then all-gathers the rebuilt slices inside the node, and a gather of unchanged weights
    crosses no node. "full" keeps the whole reference on every rank (``(1 + 1/world)`` of the
    parameters), which makes gathers of unchanged weights send nothing at all. With one rank per
    node, or nodes holding different numbers of the group's ranks, the reference is full.

    ``quantize_intra_node``: quantize collectives whose members all share one node (a one-node
    gather group, HSDP's weight all-gather and reduce-scatter inside a node). Off by default:
    only traffic that crosses nodes is quantized, the rest stays FSDP2's own, with no reference
    and no codec work; turn it on for nodes whose ranks talk over PCIe rather than NVLink.
    Two-level gradient reductions whose second hop crosses nodes keep their 8-bit first hop.

    ``consistency_check_every`` (0 = off): every K-th forward weight gather of each FSDP module,
    the ranks compare exact integer checksums of the weights they are about to compute with and
    raise naming the first parameter that differs (one tiny all-gather per module and check).
    """

    weight_scheme: WeightScheme = "none"
    weight_bits: int = 4
    weight_group_size: int = 2048
    weight_symmetric: bool = True
    weight_rounding: Rounding = "stochastic"
    weight_hadamard: bool = False
    weight_reuse_unchanged: Optional[bool] = None
    weight_reference: Reference = "node"
    verify_weight_writes: bool = True

    grad_scheme: GradScheme = "none"
    grad_intra_bits: int = 8
    grad_inter_bits: int = 4
    grad_group_size: int = 128
    grad_symmetric: bool = True
    grad_rounding: Rounding = "stochastic"
    grad_hadamard: bool = False
    grad_pipeline_chunks: int = 1
    grad_overlap: bool = False
    grad_error_feedback: ErrorFeedback = "none"
    grad_error_feedback_decay: float = 1.0

    scale_dtype: str = "float32"
    ranks_per_node: Optional[int] = None
    quantize_intra_node: bool = False
    seed: int = 0
    consistency_check_every: int = 0

    # QSDP's learned levels (``codec.levels``): "uniform" = the evenly spaced codes above;
    # "learned" = a table of 2^bits levels fitted to the values sent, refreshed every
    # ``levels_refresh_every`` calls of each module's collective and identical on all ranks.
    weight_levels: Levels = "uniform"
    grad_levels: Levels = "uniform"
    levels_refresh_every: int = 100

    # A bit budget (``docs/lowbit.md``): the mean bits per element wanted on the node-crossing
    # exchanges that send (weight gathers and the inter-node gradient hop). When set it chooses
    # weight_bits, weight_levels and grad_inter_bits (``BUDGET_FIELDS``): the first
    # ``BUDGET_LADDER`` point that fits, recomputed at every construction from the budget and
    # the other fields (which stay as given); the constructor's values of those three are
    # overwritten. ``replace`` and ``preset`` refuse to set them while a budget is set.
    bit_budget: Optional[float] = None

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "baseline": {},
        # bf16 on the wire, fp32 sums: weights gathered in bf16, gradients exchanged in bf16 and
        # summed in fp32 at the receiver, HSDP's replica all-reduce alike (collectives.cast)
        "bf16": dict(weight_scheme="bf16", grad_scheme="bf16"),
        # SDP4Bit: qWD 4-bit g2048 + TLq-HS (8-bit intra, 4-bit inter, g128, Hadamard).
        "sdp4bit": dict(weight_scheme="qwd", grad_scheme="two_level", grad_hadamard=True),
        # Ablations from SDP4Bit Table 1.
        "qwd": dict(weight_scheme="qwd"),
        "qw4": dict(weight_scheme="direct"),
        "tlq": dict(grad_scheme="two_level"),
        "tlq_hs": dict(grad_scheme="two_level", grad_hadamard=True),
        # QSDP: 8-bit weights and gradients, unbiased min-max buckets of 1024.
        "qsdp": dict(
            weight_scheme="direct", weight_bits=8, weight_group_size=1024,
            weight_symmetric=False, grad_scheme="one_level", grad_inter_bits=8,
            grad_group_size=1024, grad_symmetric=False,
        ),
        # Below the papers (benchmarks/frontier.py, docs/lowbit.md): 2-bit weight differences
        # on learned levels and 3-bit Hadamard-smoothed inter-node gradients, 8 bits inside the
        # node: 2.63 bits per node-crossing element by the wire formula (2.67 measured with
        # the level tables) instead of sdp4bit's 4.13.
        "lowbit": dict(weight_scheme="qwd", weight_bits=2, weight_levels="learned",
                       grad_scheme="two_level", grad_hadamard=True, grad_inter_bits=3),
        # ZeRO++: int8 weights (qwZ) and 4-bit gradients at both levels (qgZ), no Hadamard.
        "zeropp": dict(
            weight_scheme="direct", weight_bits=8, weight_rounding="nearest",
            grad_scheme="two_level", grad_intra_bits=4, grad_inter_bits=4,
        ),
    }

    #: (weight_bits, weight_levels, grad_inter_bits), largest first: the points the frontier
    #: measured (benchmarks/frontier.py, results/frontier). Error feedback is not on it: on the
    #: one seed measured per width the loss was higher with it at every width (undecided by
    #: the verdict rule; docs/lowbit.md).
    BUDGET_LADDER: ClassVar[tuple[tuple[int, str, int], ...]] = (
        (4, "uniform", 4), (3, "uniform", 3), (2, "learned", 3), (2, "learned", 2),
    )

    #: The fields a bit budget chooses.
    BUDGET_FIELDS: ClassVar[tuple[str, ...]] = ("weight_bits", "weight_levels", "grad_inter_bits")

    def __post_init__(self) -> None:
        owner = "QCommConfig"
        if self.bit_budget is not None:
            self._apply_budget()
        _check_choice(owner, "weight_scheme", self.weight_scheme,
                      ("none", "bf16", "direct", "qwd"))
        _check_choice(owner, "grad_scheme", self.grad_scheme,
                      ("none", "bf16", "one_level", "two_level"))
        _check_choice(owner, "weight_reference", self.weight_reference, ("node", "full"))
        for name in ("weight_symmetric", "weight_hadamard", "grad_symmetric", "grad_hadamard",
                     "grad_overlap", "quantize_intra_node", "verify_weight_writes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{owner}.{name} must be a bool, got {getattr(self, name)!r}")
        if self.weight_reuse_unchanged is not None and \
                not isinstance(self.weight_reuse_unchanged, bool):
            raise ValueError(f"{owner}.weight_reuse_unchanged must be a bool or None, got "
                             f"{self.weight_reuse_unchanged!r}")
        _check_int(owner, "grad_pipeline_chunks", self.grad_pipeline_chunks, 1, 64)
        _check_int(owner, "seed", self.seed, 0, 2**63 - 1)
        _check_int(owner, "consistency_check_every", self.consistency_check_every, 0)
        if self.ranks_per_node is not None:
            _check_int(owner, "ranks_per_node", self.ranks_per_node, 1)
        # Building the specs validates bits, group sizes, rounding and scale dtype, and the
        # error is re-raised under the QCommConfig field name the user actually set.
        for prefix, build, bits in (
            ("weight", self.weight_spec, "weight_bits"),
            ("grad", self.grad_intra_spec, "grad_intra_bits"),
            ("grad", self.grad_inter_spec, "grad_inter_bits"),
        ):
            try:
                build()
            except ValueError as e:
                msg = str(e).replace("QuantSpec.bits", f"{owner}.{bits}")
                msg = msg.replace("QuantSpec.", f"{owner}.{prefix}_")
                msg = msg.replace(f"{owner}.{prefix}_scale_dtype", f"{owner}.scale_dtype")
                raise ValueError(msg) from None
        self._check_levels()
        _check_choice(owner, "grad_error_feedback", self.grad_error_feedback,
                      ("none", "inter", "all"))
        self._check_feedback_decay()
        if self.grad_error_feedback != "none" and self.grad_scheme in ("none", "bf16"):
            raise ValueError(
                "QCommConfig.grad_error_feedback needs a quantized gradient scheme (nothing is "
                "lost to feed back without one); set grad_scheme='one_level' or 'two_level', or "
                f"grad_error_feedback='none' (got grad_scheme={self.grad_scheme!r})"
            )
        if self.grad_hadamard and self.grad_scheme in ("none", "bf16"):
            raise ValueError(
                "QCommConfig.grad_hadamard=True needs a quantized gradient scheme; set "
                f"grad_scheme='one_level' or 'two_level' (got {self.grad_scheme!r})"
            )
        if self.scale_dtype == "float16" and (self.weight_scheme in ("direct", "qwd") or
                                              self.grad_scheme in ("one_level", "two_level")):
            warnings.warn(
                "QCommConfig.scale_dtype='float16': float16 scales are subnormal below 6.1e-5 "
                "and zero below 3e-8, so a group of small values (gradients and weight "
                "differences often are; 4-bit min-max groups with a range under 4.5e-7) decodes "
                "as a constant and the rest lose precision; scale_dtype='bfloat16' costs the "
                "same 2 bytes per scale with float32's range", UserWarning, stacklevel=3)

    def _check_feedback_decay(self) -> None:
        d = self.grad_error_feedback_decay
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValueError(
                f"QCommConfig.grad_error_feedback_decay={d!r} must be a number in (0, 1]: the "
                "fraction of each step's residual kept (1.0: classic error feedback)"
            )
        if d != 1 and self.grad_error_feedback == "none":
            raise ValueError(
                f"QCommConfig.grad_error_feedback_decay={d!r} has no effect without error "
                "feedback; set grad_error_feedback='inter' or 'all', or leave the decay at 1.0"
            )

    def _check_levels(self) -> None:
        owner = "QCommConfig"
        _check_choice(owner, "weight_levels", self.weight_levels, ("uniform", "learned"))
        _check_choice(owner, "grad_levels", self.grad_levels, ("uniform", "learned"))
        _check_int(owner, "levels_refresh_every", self.levels_refresh_every, 1)
        if self.weight_levels == "learned" and self.weight_scheme in ("none", "bf16"):
            raise ValueError(
                "QCommConfig.weight_levels='learned' needs a quantized weight scheme; set "
                "weight_scheme='direct' (the weights) or 'qwd' (their differences), got "
                f"{self.weight_scheme!r}"
            )
        if self.weight_hadamard and self.weight_scheme in ("none", "bf16"):
            raise ValueError(
                "QCommConfig.weight_hadamard=True needs a quantized weight scheme; set "
                f"weight_scheme='direct' or 'qwd', got {self.weight_scheme!r}"
            )
        if self.weight_hadamard and self.weight_levels == "learned":
            raise ValueError(
                "QCommConfig.weight_hadamard=True and weight_levels='learned' do not combine "
                "(learned levels are fitted to the values as sent); pick one"
            )
        if self.grad_levels == "learned" and (
            self.grad_scheme != "one_level" or self.grad_hadamard
        ):
            raise ValueError(
                "QCommConfig.grad_levels='learned' needs grad_scheme='one_level' and "
                f"grad_hadamard=False (got grad_scheme={self.grad_scheme!r}, "
                f"grad_hadamard={self.grad_hadamard}); learned levels are QSDP's one-hop scheme"
            )

    def _apply_budget(self) -> None:
        b = self.bit_budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 2.0 <= b <= 32.0:
            raise ValueError(
                f"QCommConfig.bit_budget={b!r} must be a number of bits per element in [2, 32] "
                "(the mean over weight gathers and inter-node gradients; sdp4bit is 4.13)"
            )
        if self.weight_scheme != "qwd" or self.grad_scheme in ("none", "bf16"):
            raise ValueError(
                "QCommConfig.bit_budget chooses the widths of qWD weights and quantized "
                f"gradients (got weight_scheme={self.weight_scheme!r}, grad_scheme="
                f"{self.grad_scheme!r}); start from QCommConfig.preset('lowbit', bit_budget=...)"
            )
        for wb, levels, gb in self.BUDGET_LADDER:
            plan = dict(weight_bits=wb, weight_levels=levels, grad_inter_bits=gb)
            if dataclasses.replace(self, bit_budget=None, **plan).node_crossing_bits()[2] <= b:
                break
        else:
            raise ValueError(
                f"QCommConfig.bit_budget={b} is below the cheapest setting "
                f"({self.BUDGET_LADDER[-1]}); raise it or enlarge weight_group_size / "
                "grad_group_size"
            )
        for k, v in plan.items():
            object.__setattr__(self, k, v)

    def node_crossing_bits(self) -> tuple[float, float, float]:
        """(weight, inter-node gradient, mean) bits per element on the exchanges that send,
        for large tensors (wire format: codes plus one scale, and a minimum for min-max, per
        group; Hadamard padding ignored). Unquantized sides count 32 (fp32), "bf16" ones 16."""

        def bits(scheme: str, spec: QuantSpec) -> float:
            if scheme == "none":
                return 32.0
            if scheme == "bf16":
                return 16.0
            scale = 8 * torch.empty((), dtype=spec.torch_scale_dtype).element_size()
            return spec.bits + scale * (1 if spec.symmetric else 2) / spec.group_size

        w = bits(self.weight_scheme, self.weight_spec())
        g = bits(self.grad_scheme, self.grad_inter_spec())
        return w, g, (w + g) / 2

    @property
    def reuses_unchanged_weights(self) -> bool:
        """``weight_reuse_unchanged`` resolved: on for qWD unless set False, else as set."""
        if self.weight_reuse_unchanged is None:
            return self.weight_scheme == "qwd"
        return self.weight_reuse_unchanged

    # ---- quantizers --------------------------------------------------------------------
    def weight_spec(self) -> QuantSpec:
        return QuantSpec(
            bits=self.weight_bits, group_size=self.weight_group_size,
            symmetric=self.weight_symmetric, rounding=self.weight_rounding,
            scale_dtype=self.scale_dtype,
        )

    def _grad_spec(self, bits: int) -> QuantSpec:
        return QuantSpec(
            bits=bits, group_size=self.grad_group_size, symmetric=self.grad_symmetric,
            rounding=self.grad_rounding, scale_dtype=self.scale_dtype,
        )

    def grad_intra_spec(self) -> QuantSpec:
        """Quantizer of the intra-node hop (two-level scheme)."""
        return self._grad_spec(self.grad_intra_bits)

    def grad_inter_spec(self) -> QuantSpec:
        """Quantizer of the inter-node hop, and of the single hop of the one-level scheme."""
        return self._grad_spec(self.grad_inter_bits)

    def replica_spec(self, crosses_nodes: bool) -> QuantSpec:
        """Quantizer of HSDP's all-reduce across replicas: the inter-node one when the replica
        group crosses nodes (the usual layout: shard inside a node, replicate across nodes),
        the intra-node one of the two-level scheme when all replicas share a node."""
        if self.grad_scheme == "two_level" and not crosses_nodes:
            return self.grad_intra_spec()
        return self.grad_inter_spec()

    # ---- construction helpers ----------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "QCommConfig":
        """A named configuration (``QCommConfig.PRESETS``), optionally with field overrides."""
        cls._check_budget_changes(overrides, overrides.get("bit_budget"), f"preset({name!r})")
        if name not in cls.PRESETS:
            if isinstance(name, str) and _QSDP_STRING.match(name):
                return cls.from_qsdp_string(name, **overrides)
            raise ValueError(
                f"unknown QCommConfig preset {name!r}; known presets: {', '.join(cls.PRESETS)}, "
                "or a QSDP string such as 'W6G4' / 'W4G32-learned'"
            )
        return cls.from_dict({**cls.PRESETS[name], **overrides})

    @classmethod
    def from_qsdp_string(
        cls, text: str, *, levels: Optional[Levels] = None, group_size: int = 1024,
        **overrides: Any,
    ) -> "QCommConfig":
        """QSDP's ``W<bits>G<bits>`` settings, e.g. ``"W6G4"``, ``"W4G32"``, ``"W4G4-learned"``.

        Weights: direct min-max stochastic quantization in buckets of ``group_size`` (1024).
        Gradients: one-level min-max stochastic quantization, same buckets. ``32`` leaves that
        side unquantized (scheme "none"). ``levels`` (or a ``-uniform`` / ``-learned`` suffix)
        picks the level set of every quantized side.
        """
        m = _QSDP_STRING.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ValueError(
                f"{text!r} is not a QSDP setting; write W<bits>G<bits> with bits 2..8 or 32 "
                "(unquantized), optionally suffixed -uniform or -learned, e.g. 'W6G4-learned'"
            )
        wb, gb, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
        for side, b in (("W", wb), ("G", gb)):
            if b != 32 and not 2 <= b <= 8:
                raise ValueError(
                    f"{text!r}: {side}{b} is not supported; bits must be 2..8, "
                    "or 32 for unquantized"
                )
        if levels is not None and suffix is not None and levels != suffix.lower():
            raise ValueError(f"{text!r} says {suffix} levels but levels={levels!r} was passed")
        lv = levels or (suffix.lower() if suffix else "uniform")
        values: dict[str, Any] = {}
        if wb != 32:
            values.update(
                weight_scheme="direct", weight_bits=wb, weight_group_size=group_size,
                weight_symmetric=False, weight_rounding="stochastic", weight_levels=lv,
            )
        if gb != 32:
            values.update(
                grad_scheme="one_level", grad_inter_bits=gb, grad_intra_bits=gb,
                grad_group_size=group_size, grad_symmetric=False, grad_rounding="stochastic",
                grad_levels=lv,
            )
        return cls.from_dict({**values, **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "QCommConfig":
        """Build from a plain dict (TOML, CLI), rejecting unknown keys by name."""
        return _from_checked_dict(cls, values)

    def replace(self, **changes: Any) -> "QCommConfig":
        """A copy with ``changes``, validated anew. While ``bit_budget`` is set (here or by
        ``changes``) it chooses ``BUDGET_FIELDS``: naming one of them is an error (pass
        ``bit_budget=None`` with it to choose widths yourself), and the widths are recomputed
        from the budget and the other fields, so they stay as they are unless the budget or a
        field it depends on (group sizes, scale dtype, symmetry) changes. ``bit_budget=None``
        keeps the widths the budget chose."""
        self._check_budget_changes(changes, changes.get("bit_budget", self.bit_budget),
                                   "replace()")
        return dataclasses.replace(self, **changes)

    @classmethod
    def _check_budget_changes(cls, changes: dict, budget: Any, where: str) -> None:
        chosen = [k for k in cls.BUDGET_FIELDS if k in changes]
        if budget is not None and chosen:
            set_ = ", ".join(f"{k}={changes[k]!r}" for k in chosen)
            raise ValueError(
                f"QCommConfig.{where}: {set_} cannot be set while QCommConfig.bit_budget="
                f"{budget!r} is set (the budget chooses {', '.join(cls.BUDGET_FIELDS)}); pass "
                "bit_budget=None to set widths yourself, or change bit_budget"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


__all__ = ["ErrorFeedback", "GradScheme", "Levels", "QCommConfig", "QuantSpec", "Reference",
           "Rounding", "WeightScheme"]
