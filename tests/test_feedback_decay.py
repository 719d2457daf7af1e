"""``QCommConfig.grad_error_feedback_decay``: the fraction of each step's residual kept.

Single process: the residual bookkeeping (``error_feedback.open_residuals`` / ``compensated``)
on the real codec, the config's checks and the hooks that build the residual state. Why the
option exists (classic feedback's residual outgrows the gradient at 2 bits with stochastic
rounding) is the last test.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_qcomm import QCommConfig
from fsdp_qcomm.codec import RngKey, dequantize, quantize
from fsdp_qcomm.collectives.error_feedback import (
    FeedbackState,
    MappedFeedback,
    ValueLayout,
    compensated,
    open_residuals,
)
from fsdp_qcomm.collectives.grad_reduce import feedback_sites
from fsdp_qcomm.stats import CommStats

_EF = dict(grad_scheme="one_level", grad_group_size=32, grad_error_feedback="all")


def _sites(cfg: QCommConfig):
    return lambda n: feedback_sites(cfg, 2, n, None)


def _step(feedback, cfg: QCommConfig, x: torch.Tensor, t: int) -> torch.Tensor:
    """One quantized encoding of ``x`` ([2, n]) through the ``a2a`` site: what is delivered."""
    spec = cfg.grad_inter_spec()
    n = x.shape[-1]
    res, done = open_residuals(feedback, _sites(cfg), n, x.device)
    wire = compensated(res["a2a"], x, lambda v: quantize(v, spec, RngKey(1, t, 0, 0)),
                       lambda w: dequantize(w, n, spec))
    done()
    return dequantize(wire, n, spec)


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_kept_residual_is_decay_times_what_the_wire_lost(decay):
    cfg = QCommConfig(**_EF, grad_inter_bits=3, grad_error_feedback_decay=decay)
    state = FeedbackState(cfg.grad_error_feedback_decay)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(0))
    prev = torch.zeros_like(x)
    for t in range(3):
        got = _step(state, cfg, x, t)
        torch.testing.assert_close(state.residuals["a2a"], decay * (x + prev - got))
        prev = state.residuals["a2a"].clone()


def test_mapped_calls_decay_only_the_values_they_hold():
    cfg = QCommConfig(**_EF, grad_error_feedback_decay=0.5)
    state = FeedbackState(0.5)
    state.residuals["a2a"] = torch.full((2, 96), 3.0)
    # the call holds values [0, 32) and [64, 96) of the full layout, with a loss scale of 4
    layout = ValueLayout(((0, 32), (64, 32)), 96)
    res, done = open_residuals(MappedFeedback(state, layout, torch.tensor(4.0)), _sites(cfg),
                               64, "cpu")
    assert torch.equal(res["a2a"], torch.full((2, 64), 12.0))
    res["a2a"].fill_(8.0)  # what the call lost, scaled
    done()
    kept = state.residuals["a2a"]
    assert torch.equal(kept[:, :32], torch.full((2, 32), 1.0))  # 8 / 4 * 0.5
    assert torch.equal(kept[:, 64:], torch.full((2, 32), 1.0))
    assert torch.equal(kept[:, 32:64], torch.full((2, 32), 3.0))  # not held: untouched


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), True, "0.5"])
def test_decay_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="grad_error_feedback_decay=.* must be a number in"):
        QCommConfig(**_EF, grad_error_feedback_decay=bad)
    with pytest.raises(ValueError, match="decay must be a number in"):
        FeedbackState(bad)


def test_decay_without_feedback_is_refused():
    with pytest.raises(ValueError, match="has no effect without error feedback"):
        QCommConfig.preset("sdp4bit", grad_error_feedback_decay=0.5)
    QCommConfig.preset("sdp4bit", grad_error_feedback_decay=1.0)  # the default: fine


def test_hooks_keep_residuals_with_the_configured_decay():
    from fsdp_qcomm.fsdp.hsdp import ReplicaAllReduce
    from fsdp_qcomm.fsdp.reduce_scatter import QuantizedReduceScatter

    cfg = QCommConfig.preset("sdp4bit", grad_error_feedback="inter",
                             grad_error_feedback_decay=0.25)
    assert QuantizedReduceScatter(cfg, CommStats(), 0).feedback.decay == 0.25
    replica = ReplicaAllReduce(None, None, cfg.grad_inter_spec(), hadamard=True, seed=0,
                               bucket=0, stats=CommStats(), error_feedback=True,
                               feedback_decay=0.25)
    assert replica.feedback.decay == 0.25


def test_decay_bounds_the_residual_at_two_bit_stochastic_rounding():
    """Ternary stochastic rounding (2 bits, absmax scale) errs by about as much as the values
    it rounds: classic feedback's residual then grows past the gradient (2x here, 4x on
    Hadamard-rotated groups of 128), and with it the error each step delivers. Keeping half of
    it keeps it well under the gradient."""
    g = torch.Generator().manual_seed(3)
    ratios = {}
    for decay in (1.0, 0.5):
        cfg = QCommConfig(**_EF, grad_inter_bits=2, grad_error_feedback_decay=decay)
        state = FeedbackState(decay)
        for t in range(40):
            x = torch.randn(2, 512, generator=g) * torch.linspace(0.1, 3.0, 512)
            _step(state, cfg, x, t)
        ratios[decay] = float(state.residuals["a2a"].norm() / x.norm())
    assert ratios[1.0] > 1.5 and ratios[0.5] < 0.8, ratios
