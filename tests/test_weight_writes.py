"""Every way users write weights ends in a forward on the new weights, under every scheme.

Each case trains a small tied-embedding model for two AdamW steps, runs an evaluation forward
(so every gather has something to reuse), writes the parameters in one of the ways found in
the wild (EMA swaps, LocalSGD/DiLoCo outer steps, checkpoint loads, optimizers that are not
``torch.optim`` optimizers), and compares what each module computes with in the next forward
(captured after FSDP's unshard) with the new weights: exactly, for a full-precision resend;
within one quantization step, for a quantized difference or directly quantized weights. A write
on one rank only is an error on every rank, at once, never a hang.
"""

from __future__ import annotations

import time

import pytest
import torch
from _models import Capture, OptimizerContainer, TinyLM, batch, lm_loss, shard
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.testing import crash_note, run_ranks

# Two ranks on one host are one node: quantize_intra_node=True makes the gathers under test
# quantized (by default fsdp_qcomm leaves collectives inside a node unquantized).
_ONE_NODE = dict(quantize_intra_node=True)
SCHEMES = {
    "fsdp": None,  # FSDP's own collectives: the reference behaviour
    "none": QCommConfig(**_ONE_NODE),
    "none_kept": QCommConfig(weight_reuse_unchanged=True, **_ONE_NODE),
    "direct": QCommConfig(weight_scheme="direct", weight_bits=8, weight_group_size=16,
                          **_ONE_NODE),
    "direct_kept": QCommConfig(weight_scheme="direct", weight_bits=8, weight_group_size=16,
                               weight_reuse_unchanged=True, **_ONE_NODE),
    "qwd": QCommConfig(weight_scheme="qwd", weight_group_size=16, **_ONE_NODE),
    "qwd_learned": QCommConfig(weight_scheme="qwd", weight_bits=2, weight_group_size=16,
                               weight_levels="learned", **_ONE_NODE),
    "qwd_no_reuse": QCommConfig(weight_scheme="qwd", weight_group_size=16,
                                weight_reuse_unchanged=False, **_ONE_NODE),
}
# "@step": written right after the optimizer step, no forward between (an EMA swap for an
# evaluation, as diffusers' EMAModel.copy_to does it): the step must not explain the write
WRITES = ("copy_", "data_copy_", "data_assign", "load_state_dict", "set_model_state_dict",
          "swap_and_back", "custom_optimizer", "mark_changed", "data_copy_@step",
          "swap_and_back@step")


class _HandSGD:
    """An optimizer that is not a ``torch.optim.Optimizer``: no step hooks, writes via .data."""

    def __init__(self, params, lr: float) -> None:
        self.params, self.lr = list(params), lr

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-self.lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _exact(model) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded, as stored (``full_tensor`` gathers outside our hooks)."""
    out = {}
    for name, mod in model.named_modules():
        for p, t in mod.named_parameters(recurse=False):
            out[f"{name}.{p}"] = t.full_tensor().detach().clone()
    return out


def _forward(model, cap, rank, step) -> dict[str, torch.Tensor]:
    cap.clear()
    with torch.no_grad():
        lm_loss(model, batch(step, rank))
    return dict(cap.fwd)


def _halve(model, how: str) -> None:
    params = list(model.parameters())
    with torch.no_grad():
        if how == "copy_":
            for p in params:
                p.copy_(p * 0.5)
        elif how in ("data_copy_", "mark_changed"):
            for p in params:
                p.data.copy_(p.data * 0.5)
        elif how == "data_assign":  # DTensor drops it: FSDP2 computes with the old values
            for p in params:
                p.data = p.data * 0.5
        elif how == "load_state_dict":
            model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
        elif how == "set_model_state_dict":
            sd = get_model_state_dict(model)
            set_model_state_dict(model, {k: v * 0.5 for k, v in sd.items()})
        else:
            raise ValueError(how)


def _err(used: dict, want: dict) -> float:
    assert used.keys() == want.keys()
    return max((used[k].float() - want[k].float()).abs().max().item() for k in want)


def _bound(name: str, cfg, new: dict, old: dict) -> float:
    """How far a forward may be from the new weights: 0 for a full-precision resend, one step
    of the quantizer for directly quantized weights, or of the change from ``old`` (what the
    previous forward computed with: qWD's reference) for a quantized difference."""
    if cfg is None or cfg.weight_scheme == "none":
        return 0.0
    qmax = cfg.weight_spec().qmax
    if cfg.weight_scheme == "direct":
        return max(v.abs().max().item() for v in new.values()) / qmax * 1.001
    if cfg.weight_levels == "learned":  # 4 levels fitted to the change: within its range
        return max((new[k] - old[k]).abs().max().item() for k in new) * 1.001
    return max((new[k] - old[k]).abs().max().item() for k in new) / qmax * 1.001


def _case(rank, name, how) -> dict:
    crash_note(f"_case({name!r}, {how!r})")  # which case, if this rank dies in native code
    cfg = SCHEMES[name]
    torch.manual_seed(0)
    model = TinyLM()
    shard(model, True)
    handle = fsdp_qcomm.enable(model, cfg) if cfg is not None else None
    if how == "custom_optimizer":  # the whole run with it: no torch.optim hook ever fires
        opt = _HandSGD(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2, foreach=True)
    for step in range(2):
        lm_loss(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    cap = Capture(model)
    how, _, at = how.partition("@")
    if at:  # the bound is moot under qWD: the write must arrive exactly
        old = _exact(model)
    else:
        old = _forward(model, cap, rank, 50)  # what the gathers delivered last (qWD: reference)
    modes0 = handle.gather_modes() if handle is not None else {}
    out = {}
    if how == "swap_and_back":
        ema = [p.detach().clone() * 0.5 for p in model.parameters()]
        orig = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p, e in zip(model.parameters(), ema):
                p.data.copy_(e)
        new = _exact(model)
        used = _forward(model, cap, rank, 51)
        out["swapped"] = (_err(used, new), _bound(name, cfg, new, old))
        with torch.no_grad():
            for p, o in zip(model.parameters(), orig):
                p.data.copy_(o)
        back = _exact(model)
        out["back"] = (_err(_forward(model, cap, rank, 52), back), _bound(name, cfg, back, used))
    elif how == "custom_optimizer":
        lm_loss(model, batch(7, rank)).backward()
        opt.step()
        opt.zero_grad()
        new = _exact(model)
        out["after"] = (_err(_forward(model, cap, rank, 51), new), _bound(name, cfg, new, old))
    else:
        _halve(model, how)
        if how == "mark_changed" and handle is not None:
            handle.mark_changed()
        new = _exact(model)
        used = _forward(model, cap, rank, 51)
        reuses = cfg is None or cfg.reuses_unchanged_weights or cfg.weight_scheme != "qwd"
        if how == "data_assign" and reuses:  # nothing changed for FSDP2: the same weights
            out["after"] = (_err(used, old), 0.0)
        else:
            out["after"] = (_err(used, new), _bound(name, cfg, new, old))
    if handle is not None:
        modes = handle.gather_modes()
        out["modes"] = {k: modes.get(k, 0) - modes0.get(k, 0) for k in modes}
        handle.disable()
    cap.remove()
    return out


def _all_cases(rank, world, names) -> dict:
    return {(name, how): _case(rank, name, how) for name in names for how in WRITES}


@pytest.fixture(scope="module")
def cases() -> dict:
    return run_ranks(_all_cases, 2, list(SCHEMES), timeout=600)[0]


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("how", WRITES)
def test_a_write_reaches_the_next_forward(cases, name, how):
    res = cases[(name, how)]
    for label, value in res.items():
        if label == "modes":
            continue
        err, bound = value
        assert err <= bound, f"{name}, {how} ({label}): forward is {err} from the new weights"
    cfg = SCHEMES[name]
    if cfg is None or cfg.weight_scheme != "qwd":
        return
    modes = res["modes"]
    if how == "mark_changed":  # a quantized difference, not a full-precision resend
        assert modes.get("qwd_diff", 0) > 0 and modes.get("qwd_full", 0) == 0, modes
    elif how == "custom_optimizer":  # a gradient reduction and changed values: a step
        assert modes.get("qwd_full", 0) == 0 and modes.get("qwd_diff", 0) > 0, modes
    elif how == "data_assign":  # the values did not change: nothing to send (unless no reuse)
        assert modes.get("qwd_full", 0) == 0, modes
        assert modes.get("qwd_diff", 0) == (0 if cfg.reuses_unchanged_weights else 3), modes
    else:  # a write nothing declared: full precision, exact
        assert modes.get("qwd_full", 0) > 0, modes
        for label, value in res.items():
            if label != "modes":
                assert value[0] == 0.0, (label, value)


# ---- a write on some ranks only -----------------------------------------------------------
def _one_rank_writes(rank, world, how):
    torch.manual_seed(0)
    model = TinyLM()
    shard(model, True)
    handle = fsdp_qcomm.enable(model, SCHEMES["qwd"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    lm_loss(model, batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()
    cap = Capture(model)
    before = _forward(model, cap, rank, 1)
    if rank == 0:
        with torch.no_grad():
            if how == "version":
                model.norm.weight.mul_(0.5)
            else:
                model.norm.weight.data.mul_(0.5)
    t0 = time.monotonic()
    try:
        used = _forward(model, cap, rank, 2)
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    new = _exact(model)
    root = ("emb.weight", "head.weight", "norm.weight", "norm.bias")  # the written module's
    out = {"error": None, "err": _err({k: used[k] for k in root}, {k: new[k] for k in root}),
           "others": _err({k: v for k, v in used.items() if k not in root},
                          {k: v for k, v in before.items() if k not in root})}
    handle.disable()
    return out


def test_a_write_on_one_rank_only_fails_fast_on_every_rank():
    # p.mul_ on rank 0 only: version counters moved on rank 0 alone. Every rank raises the
    # same error, naming the module and the ranks, long before the process group would time out.
    res = run_ranks(_one_rank_writes, 2, "version", timeout=120)
    for r in res:
        assert r["error"] is not None and r["seconds"] < 30, r
        assert "disagree about what changed in FSDP module '<root>'" in r["error"], r["error"]
        assert "global rank(s) [0]: a write outside an optimizer step" in r["error"], r["error"]
        assert "global rank(s) [1]: nothing" in r["error"], r["error"]
    assert res[0]["error"] == res[1]["error"]


def test_a_data_write_on_one_rank_runs_like_fsdp():
    # p.data on rank 0 only: no version moved, only rank 0's content. One changed shard is
    # enough for every rank to re-send: both compute with the shards as they are, exactly what
    # FSDP2 itself computes.
    res = run_ranks(_one_rank_writes, 2, "data", timeout=120)
    for r in res:  # the written module re-sent at full precision, the others reused
        assert r["error"] is None and r["err"] == 0.0 and r["others"] == 0.0, r


# ---- reuse can be turned off under qWD ------------------------------------------------------
def _no_reuse(rank, world):
    out = {}
    for name in ("qwd", "qwd_no_reuse"):
        torch.manual_seed(0)
        model = TinyLM()
        shard(model, True)
        handle = fsdp_qcomm.enable(model, SCHEMES[name])
        cap = Capture(model)
        for step in range(3):  # forwards with nothing changed in between
            _forward(model, cap, rank, step)
        out[name] = handle.gather_modes()
        cap.remove()
        handle.disable()
    return out


def test_weight_reuse_unchanged_false_turns_qwd_reuse_off():
    for r in run_ranks(_no_reuse, 2):
        units = r["qwd"]["qwd_full"]
        assert r["qwd"] == {"qwd_full": units, "qwd_reuse": 2 * units}, r
        assert r["qwd_no_reuse"] == {"qwd_full": units, "qwd_diff": 2 * units}, r


# ---- weights FSDP still holds from before a change --------------------------------------------
# FSDP2 gathers nothing for a module it holds unsharded (from the post-forward shards for one
# sharded over its post-forward group, from a pending gather for one unshard(async_op=True) left
# unwaited): an optimizer step taken while it holds them is lost to the next forward, without an
# error. Each pattern below does that in one step of a loop users write.
HELD = ("evaluation_before_step", "evaluation_before_step_post_forward",
        "reshard_after_backward_false", "unshard_before_step", "unshard_async_before_step")
#: a gather with no change tracker (FSDP's own weights), qWD's and a direct scheme's
HELD_SCHEMES = ("none", "qwd", "direct")


def _held(rank, world, how):
    out = {}
    for name in ("fsdp",) + HELD_SCHEMES:
        for variant in ("as_usual", how):
            crash_note(f"_held({name!r}, {variant!r})")
            torch.manual_seed(0)
            model = TinyLM()
            for blk in model.blocks:  # 4 ranks: resharded over 2 after forward
                fully_shard(blk, reshard_after_forward=2 if "post_forward" in how else True)
            fully_shard(model)  # FSDP2's default: the root keeps its weights after forward
            sharded = {f"{m}.{p}": t for m, mod in model.named_modules()
                       for p, t in mod.named_parameters(recurse=False)}
            cfg = SCHEMES[name]
            handle = fsdp_qcomm.enable(model, cfg) if cfg is not None else None
            opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
            if variant == "reshard_after_backward_false":
                model.set_reshard_after_backward(False)
            lm_loss(model, batch(0, rank)).backward()
            if variant.startswith("evaluation_before_step"):
                with torch.no_grad():
                    lm_loss(model, batch(1, rank))
            elif variant == "unshard_before_step":
                model.unshard()
            elif variant == "unshard_async_before_step":
                model.unshard(async_op=True)  # a prefetch of the next forward's weights
            opt.step()
            opt.zero_grad()
            new = {k: t.full_tensor().detach().clone() for k, t in sharded.items()}
            cap = Capture(model)
            error, modes = None, None
            before = handle.gather_modes() if handle is not None else None
            try:
                used = _forward(model, cap, rank, 2)
            except RuntimeError as e:
                error, modes = str(e), handle.gather_modes()
                if variant == "unshard_async_before_step":
                    model.unshard()  # waits for the pending gather, as the error says
                for mod in model.modules():
                    if isinstance(mod, FSDPModule):
                        mod.reshard()
                used = _forward(model, cap, rank, 2)
            out[name, variant] = {"error": error, "used": used, "new": new,
                                  "sent": modes != before}
            cap.remove()
            if handle is not None:
                handle.disable()
    return out


@pytest.fixture(scope="module")
def held() -> dict:
    return {how: run_ranks(_held, 4 if "post_forward" in how else 2, how, timeout=300)
            for how in HELD}


@pytest.mark.parametrize("how", HELD)
def test_a_forward_on_weights_held_from_before_a_step_fails_on_every_rank(held, how):
    root = ("emb.weight", "head.weight", "norm.weight", "norm.bias")
    root_held = ("gathered by an unshard(async_op=True)" if "async" in how else "unsharded")
    blocks_held = ("unsharded" if how == "reshard_after_backward_false" else
                   "sharded over its post-forward group" if "post_forward" in how else None)
    for r in held[how]:
        usual = r["fsdp", "as_usual"]
        assert usual["error"] is None and _err(usual["used"], usual["new"]) == 0.0
        # FSDP2 alone: no error, and the root computes with the weights from before the step
        fsdp = r["fsdp", how]
        assert fsdp["error"] is None, fsdp["error"]
        assert _err({k: fsdp["used"][k] for k in root}, {k: fsdp["new"][k] for k in root}) > 0
        for name in HELD_SCHEMES:
            got, want = r[name, how], r[name, "as_usual"]
            assert want["error"] is None, want["error"]
            error = got["error"]
            assert error is not None and not got["sent"], (name, error)
            assert f"FSDP module(s) '<root>' ({root_held}" in error, error
            assert "since then: an optimizer step or handle.mark_changed())" in error, error
            assert "set_reshard_after_backward(True)" in error and "reshard()" in error, error
            for blk in ("blocks.0", "blocks.1"):
                assert (f"'{blk}' ({blocks_held}" in error) == (blocks_held is not None), error
            # after the resharding the error asks for, the forward computes with the weights
            # the usual loop computes with (the same gathers: bit for bit)
            assert got["used"].keys() == want["used"].keys()
            for k, v in want["used"].items():
                assert torch.equal(got["used"][k], v), (name, k)
    for name in HELD_SCHEMES:
        assert len({r[name, how]["error"] for r in held[how]}) == 1


def _one_rank_prefetch(rank, world):
    # One rank: FSDP calls no all-gather and copies the shards when an unshard is waited on, so
    # a prefetch before the step computes with the stepped weights: nothing to refuse.
    out = {}
    for name in ("fsdp", "none"):
        torch.manual_seed(0)
        model = TinyLM()
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        sharded = {f"{m}.{p}": t for m, mod in model.named_modules()
                   for p, t in mod.named_parameters(recurse=False)}
        cfg = SCHEMES[name]
        handle = fsdp_qcomm.enable(model, cfg) if cfg is not None else None
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
        lm_loss(model, batch(0, rank)).backward()
        model.unshard(async_op=True)
        opt.step()
        new = {k: t.full_tensor().detach().clone() for k, t in sharded.items()}
        cap = Capture(model)
        out[name] = _err(_forward(model, cap, rank, 2), new)
        cap.remove()
        if handle is not None:
            handle.disable()
    return out


def test_a_prefetch_before_the_step_on_one_rank_computes_with_the_stepped_weights():
    (r,) = run_ranks(_one_rank_prefetch, 1)
    assert r == {"fsdp": 0.0, "none": 0.0}, r


# ---- an optimizer whose closure runs forwards inside its step -------------------------------
def _closure_steps(rank, world):
    torch.manual_seed(0)
    model = TinyLM(vocab=38, hidden=46)  # LBFGS flattens each DTensor: even shards only
    shard(model, True)
    handle = fsdp_qcomm.enable(model, SCHEMES["qwd"])
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=3)
    cap = Capture(model)
    errs = []

    def closure():
        opt.zero_grad()
        new = _exact(model)
        cap.clear()
        loss = lm_loss(model, batch(0, rank))
        errs.append(_err(dict(cap.fwd), new))
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    out = {"errs": errs, "modes": handle.gather_modes(), "modules": len(handle._installs),
           "notes": handle.stats().get("notes", [])}
    cap.remove()
    handle.disable()
    return out


def test_an_optimizer_closure_computes_with_the_weights_its_step_wrote():
    """``torch.optim.LBFGS`` writes the parameters (``p.add_``) inside its step and runs the
    closure's forward before the step ends, where no finished step explains the write: each
    closure forward gets the written weights exactly (a full-precision resend, named in the
    notes), never a stale or quantized copy."""
    for r in run_ranks(_closure_steps, 2):
        assert len(r["errs"]) >= 4 and all(e == 0.0 for e in r["errs"]), r["errs"]
        modes = r["modes"]
        assert modes.get("qwd_full", 0) > r["modules"], modes  # beyond the first gathers
        assert any("no torch.optim optimizer step explains" in n for n in r["notes"]), r


# ---- how optimizer steps are seen -----------------------------------------------------------
def _container_steps(rank, world):
    from fsdp_qcomm.fsdp import change_tracker

    torch.manual_seed(0)
    model = TinyLM()
    shard(model, True)
    handle = fsdp_qcomm.enable(model, SCHEMES["qwd"])
    opt = OptimizerContainer(torch.optim.AdamW(model.parameters(), lr=3e-2))
    calls = []
    digests = change_tracker.step_digests
    change_tracker.step_digests = lambda ts: (calls.append(len(ts)), digests(ts))[1]
    try:
        for step in range(5):
            lm_loss(model, batch(step, rank)).backward()
            opt.fail = step == 2
            try:
                opt.step()
            except RuntimeError:
                assert step == 2
            opt.inner.zero_grad()
        cap = Capture(model)

        def written_then_forward(step):  # a p.data write after the step: sent exactly?
            with torch.no_grad():
                for p in model.parameters():
                    p.data.mul_(0.5)
            modes0 = handle.gather_modes()
            new = _exact(model)
            err = _err(_forward(model, cap, rank, step), new)
            full = handle.gather_modes().get("qwd_full", 0) - modes0.get("qwd_full", 0)
            return err, full

        # a step right after another optimizer's step interrupted for good: its digest waits
        # for a step that never ends
        other = OptimizerContainer(torch.optim.SGD(model.parameters(), lr=0.0), fail=True)
        lm_loss(model, batch(5, rank)).backward()
        try:
            other.step()
        except RuntimeError:
            pass
        opt.step()
        opt.inner.zero_grad()
        after_other = written_then_forward(6)
        # the container's own step raising after its inner step: no digest either
        lm_loss(model, batch(7, rank)).backward()
        opt.fail = True
        try:
            opt.step()
        except RuntimeError:
            pass
        opt.inner.zero_grad()
        after_raise = written_then_forward(8)
        # and a gather outside the forward after such a step (unshard()): it re-sends, and the
        # forward on the weights it holds is no stale use
        lm_loss(model, batch(9, rank)).backward()
        try:
            opt.step()
        except RuntimeError:
            pass
        opt.inner.zero_grad()
        new = _exact(model)  # (full_tensor of the shards: before unshard() swaps them out)
        model.unshard()
        after_unshard = _err(_forward(model, cap, rank, 10), new)
        cap.remove()
    finally:
        change_tracker.step_digests = digests
    out = {"calls": calls, "after_other": after_other, "after_raise": after_raise,
           "after_unshard": after_unshard,
           "modules": len(handle._installs)}
    handle.disable()
    return out


def test_an_optimizer_container_digests_each_stepped_shard_once_per_step():
    """The shards a step wrote are digested once its outermost optimizer's step ends (every
    module in one call), not once per nested step; a container step that raised after its
    inner step leaves the next steps digesting as before (the forward after it closes it); a
    p.data write after a container's step reaches the next forward exactly, also where the
    step's digest was never taken (after another optimizer's step interrupted for good)."""
    for r in run_ranks(_container_steps, 2):
        assert r["calls"] == [r["modules"]] * 4, r  # steps 0, 1, 3, 4: no raised one ends
        for where in ("after_other", "after_raise"):  # re-sent exactly, every module
            assert r[where] == (0.0, r["modules"]), (where, r)
        assert r["after_unshard"] == 0.0, r


def _grads_freed_after_the_step(rank, world):
    cfg = QCommConfig(weight_scheme="qwd", weight_group_size=16, verify_weight_writes=False,
                      **_ONE_NODE)
    torch.manual_seed(0)
    model = TinyLM()
    shard(model, True)
    handle = fsdp_qcomm.enable(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, foreach=True)  # no version bumps
    lm_loss(model, batch(0, rank)).backward()
    opt.step()  # seen: from here on no gradient reduction stands in for a step
    opt.zero_grad()
    opt.register_step_post_hook(lambda o, args, kwargs: o.zero_grad(set_to_none=True))
    cap = Capture(model)
    old = _forward(model, cap, rank, 50)
    lm_loss(model, batch(1, rank)).backward()
    opt.step()
    new = _exact(model)
    used = _forward(model, cap, rank, 51)
    out = {"err": _err(used, new), "bound": _bound("qwd", cfg, new, old),
           "modes": handle.gather_modes()}
    cap.remove()
    handle.disable()
    return out


def test_a_step_whose_gradients_a_hook_frees_still_counts():
    """An optimizer's own post hook runs before the global one ``enable`` installs; one that
    frees the gradients must not hide the step: with ``verify_weight_writes=False`` nothing
    else would find it, and the next forward would compute with the old weights."""
    for r in run_ranks(_grads_freed_after_the_step, 2):
        assert r["err"] <= r["bound"] and r["modes"].get("qwd_diff", 0) > 0, r
