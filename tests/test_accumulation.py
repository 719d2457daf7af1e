"""Real training loops: one weight exchange per optimizer step, exact backward weights.

Gradient accumulation (``set_requires_gradient_sync(False)`` on all but the last micro-batch,
``reshard_after_forward=True``), forward-only evaluation, several forwards before one backward,
``reset()``, loads and outside writes, on real gloo ranks. Checks bytes handed to the process
group against the wire format, losses against the run where FSDP itself gathers once per step
(``reshard_after_forward=False``), bit for bit, and that every rank takes the same decisions
(the consistency guard compares them at every forward gather).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _models import Capture, GatherBytes, TinyLM, batch, lm_loss, shard
from _models import segments as _segments
from _models import units as _groups
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp_qcomm
from fsdp_qcomm import QCommConfig, wire_bytes
from fsdp_qcomm.testing import run_ranks
from fsdp_qcomm.testing import same_on_all_ranks as _same_on_all_ranks

# Two ranks on one host: one node, whose gathers fsdp_qcomm would leave unquantized by default;
# quantize_intra_node=True puts them through the quantized paths under test.
_ONE_NODE = dict(quantize_intra_node=True)
_SCHEMES = {
    "fsdp": None,  # FSDP's own collectives, no hooks
    "none_kept": QCommConfig(weight_reuse_unchanged=True, **_ONE_NODE),
    "direct": QCommConfig(weight_scheme="direct", weight_group_size=16, **_ONE_NODE),
    "direct_kept": QCommConfig(
        weight_scheme="direct", weight_group_size=16, weight_reuse_unchanged=True, **_ONE_NODE
    ),
    "qwd": QCommConfig(weight_scheme="qwd", weight_group_size=16, **_ONE_NODE),
}


def _exchange_bytes(name: str, groups: list, first: bool, itemsize: int) -> int:
    """What one weight exchange of every module sends per rank, by the wire format."""
    total = 0
    for g in groups:
        segs = _segments(g)
        if name == "none_kept" or (name == "qwd" and first):
            total += sum(segs) * itemsize
        else:
            spec = _SCHEMES[name].weight_spec()
            total += sum(wire_bytes(s, spec) for s in segs)
    return total


def _train(model, opt, k: int, steps: int, rank: int, raf: bool, on_step=None):
    """``steps`` optimizer steps of ``k`` micro-batches each, an evaluation pass first.
    Returns (losses, bytes handed to all_gather_single per step)."""
    losses, sent = [], []
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        with GatherBytes() as bc:
            with torch.no_grad():  # forward-only evaluation between optimizer steps
                losses.append(lm_loss(model, batch(10_000 + step, rank)).item())
            for m in range(k):
                last = m == k - 1
                model.set_requires_gradient_sync(last)
                if not raf:  # FSDP's own "one gather per step": keep the weights unsharded
                    model.set_reshard_after_backward(last)
                loss = lm_loss(model, batch(step * k + m, rank))
                loss.backward()
                losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        sent.append(bc.sent)
    return losses, sent


def _accumulation(rank, world, names, ks, steps):
    out = {}
    for name in names:
        cfg = _SCHEMES[name]
        for k in ks:
            for raf in (True, False):
                torch.manual_seed(0)
                model = TinyLM()
                shard(model, raf)
                handle = fsdp_qcomm.enable(model, cfg) if cfg is not None else None
                # foreach: its steps leave the parameters' version counters untouched, so only
                # the optimizer hooks can tell the gathers that the weights changed
                opt = torch.optim.AdamW(model.parameters(), lr=3e-2, foreach=True)
                losses, sent = _train(model, opt, k, steps, rank, raf)
                out[(name, k, raf)] = losses
                if handle is None:
                    continue
                groups = _groups(model)
                units = len(groups)
                shard_elems = sum(sum(_segments(g)) for g in groups)
                tag = f"{name} K={k} raf={raf}"
                # one exchange per optimizer step whatever K, except FSDP's own raf=True path
                # under direct quantization without kept weights, which re-sends the same bytes
                agreement = 8 * units * (1 + k)  # one int64 per module per root forward
                for step, got in enumerate(sent):
                    want = _exchange_bytes(name, groups, step == 0, 4)
                    if name == "direct" and raf:
                        want *= 1 + 2 * k  # evaluation, K forwards, K backward re-gathers
                    assert got == want + agreement, \
                        f"{tag} step {step}: sent {got} B, wire format {want} + {agreement}"
                assert handle.stats()["agreement"]["sent_bytes"] == steps * agreement
                st = handle.stats()["weight_allgather"]
                assert st["sent_bytes"] + steps * agreement == sum(sent), tag
                modes = handle.gather_modes()
                gathers = units * steps * ((1 + 2 * k) if raf else 1)
                assert sum(modes.values()) == gathers == st["calls"], (tag, modes)
                if name == "qwd":
                    assert modes["qwd_full"] == units and modes["qwd_diff"] == units * (steps - 1)
                if name != "direct":
                    assert st["sending_calls"] == units * steps, (tag, st)
                    assert st["sending_elements"] == steps * shard_elems
                    assert st["elements"] == gathers // units * shard_elems
                    # per gather that sends vs averaged over every gather (0-byte ones too)
                    assert st["sending_bits_per_element"] == pytest.approx(
                        8 * st["sent_bytes"] / st["sending_elements"], rel=1e-12)
                    assert st["bits_per_element"] == pytest.approx(
                        st["sending_bits_per_element"] * st["sending_elements"]
                        / st["elements"], rel=1e-12)
                if name in ("direct_kept", "none_kept"):  # one unsharded copy plus one shard
                    assert handle.reference_bytes() == (world + 1) * shard_elems * 4
                handle.disable()
    return out


@pytest.mark.long
def test_accumulation_one_exchange_per_step_losses_bit_identical():
    names = list(_SCHEMES)
    res = run_ranks(_accumulation, 2, names, [1, 2, 4], 3)
    for r in res:
        for name in names:
            for k in (1, 2, 4):
                # reuse computes with exactly the weights FSDP's single gather per step gives
                assert r[(name, k, True)] == r[(name, k, False)], (name, k)
        for k in (1, 2, 4):
            # exact weights: our plain gather (with kept weights) is FSDP's own gather
            assert r[("none_kept", k, True)] == r[("fsdp", k, True)], k
            # kept or re-sent, a direct gather of unchanged weights has the same bits
            assert r[("direct_kept", k, True)] == r[("direct", k, True)], k
        assert r[("qwd", 2, True)] != r[("fsdp", 2, True)]  # quantization is at work


# ---- every rank decides alike: the consistency guard at every forward gather -------------------
class _GatedLM(TinyLM):
    """TinyLM plus a 3-row gate: on 4 ranks the last rank's shard of it is empty."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(22, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        return logits + self.gate(self.emb(tokens)).mean(-1, keepdim=True)


def _spmd(rank, world):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    k, steps = 3, 5
    report = {}
    for name in ("qwd", "direct_kept"):
        torch.manual_seed(0)
        model = _GatedLM()
        shard(model, True, mp)
        assert model.gate.bias.to_local().numel() == (0 if rank == 3 else 1)
        handle = fsdp_qcomm.enable(model, _SCHEMES[name].replace(consistency_check_every=1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        units = len(_groups(model))
        per_step = []

        def events(step):
            if step == 2:
                handle.reset()
            elif step == 3:  # an outside write to the root module's parameters only
                with torch.no_grad():
                    model.gate.weight.mul_(0.5)
            elif step == 4:
                model.load_state_dict(model.state_dict())
            per_step.append(dict(handle.gather_modes()))

        _train(model, opt, k, steps, rank, True, on_step=events)
        modes = handle.gather_modes()
        reuses = units * steps * 2 * k  # every micro-batch forward and backward re-gather
        if name == "qwd":
            # full: first step, reset, root after the outside write, all after the load
            assert modes == {"qwd_full": 3 * units + 1, "qwd_diff": 2 * units - 1,
                             "qwd_reuse": reuses}, modes
        else:
            assert modes == {"direct": steps * units, "direct_reuse": reuses}, modes
        report[name] = (per_step, modes)
        handle.disable()
    _same_on_all_ranks({"modes": torch.tensor([hash(str(report))], dtype=torch.int64)},
                       "gather decisions")

    # A rank deciding differently is caught before anything is gathered: here rank 1 alone
    # resets one module; the agreement before the next forward names it, on every rank.
    torch.manual_seed(0)
    model = _GatedLM()
    shard(model, True)
    handle = fsdp_qcomm.enable(model, _SCHEMES["direct"].replace(consistency_check_every=1))
    model.set_requires_gradient_sync(False)  # a micro-batch: the next gathers reuse the key
    lm_loss(model, batch(0, rank)).backward()
    if rank == 1:
        _groups(model.blocks[0])[0]._all_gather_comm.reset()
    with pytest.raises(RuntimeError, match=r"disagree about what changed .*'blocks\.0'.*"
                       r"global rank\(s\) \[1\]: handle\.reset\(\)"):
        lm_loss(model, batch(1, rank)).backward()
    return True


def test_every_rank_decides_alike_4_ranks_bf16_empty_shards():
    run_ranks(_spmd, 4)


# ---- several forwards before one backward; what is refused -----------------------------------
def _forwards(rank, world):
    for name in ("qwd", "direct", "direct_kept"):
        cfg = _SCHEMES[name]
        # two forwards, one backward: both forwards and the backward use the same weights
        torch.manual_seed(0)
        model = TinyLM()
        shard(model, True)
        handle = fsdp_qcomm.enable(model, cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cap = Capture(model)
        for step in range(3):
            cap.clear()
            with GatherBytes() as bc:
                loss = lm_loss(model, batch(2 * step, rank))
                first = dict(cap.fwd)
                loss = loss + lm_loss(model, batch(2 * step + 1, rank))
                sent_forwards = bc.sent
                loss.backward()
            for k, v in cap.fwd.items():
                assert torch.equal(v, first[k]), f"{name}: second forward's {k} differs"
            assert len(cap.bwd_log) > len(cap.bwd)  # both forwards' backwards were captured
            for entry in cap.bwd_log:
                for k, v in entry.items():
                    assert torch.equal(v, first[k]), f"{name} step {step}: backward {k} differs"
            want = _exchange_bytes(name, _groups(model), step == 0, 4)
            agreement = 2 * 8 * len(_groups(model))  # one int64 per module per forward
            if name == "direct":  # every gather of the step re-sends under the step's one key
                keys = [g._all_gather_comm._counter for g in _groups(model)]
                assert keys == [step + 1] * len(keys), keys
                assert sent_forwards == 2 * want + agreement
            else:  # only the first forward sends
                assert sent_forwards == bc.sent == want + agreement, name
            opt.step()
            opt.zero_grad()
        cap.remove()

        # an optimizer step between a forward and its backward: refused before anything is sent
        loss = lm_loss(model, batch(9, rank))
        loss.backward()
        loss = lm_loss(model, batch(10, rank))
        opt.step()  # the previous step's gradients, still there
        with GatherBytes() as bc, pytest.raises(
            RuntimeError, match=r"needs the weights its forward computed with.*optimizer step"
        ):
            loss.backward()
        assert bc.sent == 0
        handle.disable()

        # something changed between two forwards of one backward: the earlier one is refused
        for change in ("reset", "write"):
            torch.manual_seed(0)
            model = TinyLM()
            shard(model, True)
            handle = fsdp_qcomm.enable(model, cfg)
            loss = lm_loss(model, batch(0, rank))
            if change == "reset":
                handle.reset()
            else:
                with torch.no_grad():
                    model.norm.weight.add_(1.0)
            loss = loss + lm_loss(model, batch(1, rank))
            with pytest.raises(RuntimeError, match="reached a forward that computed with older"):
                loss.backward()
            handle.disable()

    # Refused only when a gather would deliver other weights: with reshard_after_forward=False
    # and no resharding after backward, the forwards' weights stay unsharded through the
    # backward, so a reset between two forwards changes nothing they compute with
    torch.manual_seed(0)
    model = TinyLM()
    shard(model, False)
    model.set_reshard_after_backward(False)
    handle = fsdp_qcomm.enable(model, _SCHEMES["qwd"])
    lm_loss(model, batch(0, rank)).backward()
    cap = Capture(model)
    loss = lm_loss(model, batch(1, rank))
    handle.reset()
    (loss + lm_loss(model, batch(2, rank))).backward()
    for entry in cap.bwd_log:
        for k, v in entry.items():
            assert torch.equal(v, cap.fwd[k]), k
    cap.remove()
    handle.disable()

    # weight_scheme="none" gathers exact weights: FSDP's own semantics, nothing refused
    torch.manual_seed(0)
    model = TinyLM()
    shard(model, True)
    handle = fsdp_qcomm.enable(model, QCommConfig())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lm_loss(model, batch(0, rank)).backward()
    loss = lm_loss(model, batch(1, rank))
    opt.step()
    loss.backward()
    handle.disable()
    return True


def test_several_forwards_one_backward_exact_or_refused():
    run_ranks(_forwards, 2)


# ---- optimizers the hooks do not see --------------------------------------------------------
def _untracked(rank, world):
    torch.manual_seed(0)
    model = TinyLM()
    shard(model, True)
    handle = fsdp_qcomm.enable(model, _SCHEMES["qwd"])
    spec = _SCHEMES["qwd"].weight_spec()
    cap = Capture(model)
    prev = None
    for step in range(4):
        exact = {n: p.full_tensor() for n, p in model.named_parameters(remove_duplicate=False)}
        cap.clear()
        for m in range(2):  # accumulation: the second micro-batch reuses
            model.set_requires_gradient_sync(m == 1)
            lm_loss(model, batch(2 * step + m, rank)).backward()
        for n, used in cap.fwd.items():  # the weights follow the exact ones
            x = exact[n]
            bound = 0.0 if prev is None else (x - prev[n]).abs().max().item() / spec.qmax
            assert (used - x).abs().max().item() <= bound * (1 + 1e-5) + 1e-7, (step, n)
        prev = dict(cap.fwd)
        # a hand-written SGD step through .data: no optimizer hook, no version bump; the
        # gradient reduction that preceded it is what tells the next gather to exchange
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.5)
                p.grad = None
    assert handle.gather_modes() == {"qwd_full": 3, "qwd_diff": 9, "qwd_reuse": 36}
    # a .data write with no gradient reduction before it: found by content, re-sent at full
    # precision, so the very next forward computes with it (a forward first takes the
    # hand-written step above: a reduction and changed values, a quantized difference)
    with torch.no_grad():
        lm_loss(model, batch(98, rank))
        model.norm.weight.data.fill_(2.0)
    cap.clear()
    lm_loss(model, batch(99, rank)).backward()
    assert torch.equal(cap.fwd["norm.weight"], torch.full((22,), 2.0))
    assert handle.gather_modes()["qwd_full"] == 4 and handle.gather_modes()["qwd_diff"] == 12
    cap.remove()
    handle.disable()
    return True


def test_optimizer_without_hooks_is_seen_through_gradient_reductions():
    run_ranks(_untracked, 2)
