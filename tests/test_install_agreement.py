"""``enable`` refuses on every rank alike (``fsdp.install_agreement``): ranks given different
configurations or module filters stop with the difference named, instead of exchanging bytes the
others cannot decode (the Hadamard rotation on one rank only trained on garbage without an
error; other differences aborted gloo or would hang NCCL), and a check that fails on one rank
stops all of them, not only that one.

Launches: 2 gloo ranks, once; the verdict's cases run without processes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.collectives.agreement import ranks_text
from fsdp_qcomm.fsdp import install_agreement as agreement
from fsdp_qcomm.fsdp import internals
from fsdp_qcomm.fsdp.hop_plan import ModulePlan
from fsdp_qcomm.testing import run_ranks

_MESH = ((0, 1, 2, 3), (4,), ("dp",))


def _entry(label: str, index: int, config: QCommConfig, mesh=_MESH, reference=True):
    plan = ModulePlan(weights=config, node_reference=reference, reduce_scatter=config,
                      replica=None, why=())
    return agreement.Entry(mesh, label, index, config, plan)


def _world(*per_rank) -> list[dict]:
    """Payloads as the exchange hands them to every rank: per rank, its entries."""
    return [agreement.payload(entries) for entries in per_rank]


_SDP4 = QCommConfig.preset("sdp4bit", ranks_per_node=2)
_SAME = [_entry("layers.0", 0, _SDP4), _entry("layers.1", 1, _SDP4), _entry("<root>", 2, _SDP4)]


def test_ranks_that_install_alike_agree():
    assert agreement.verdict(_world(*[_SAME] * 4)) is None


def test_a_field_that_differs_is_named_with_its_values_and_ranks():
    other = [_SAME[0], _entry("layers.1", 1, _SDP4.replace(grad_hadamard=False)), _SAME[2]]
    text = agreement.verdict(_world(_SAME, _SAME, other, _SAME))
    assert text.startswith("fsdp_qcomm.enable(): the ranks of the device mesh (dp=4) over "
                           "ranks [0-3] would install different collectives"), text
    assert ("FSDP module 'layers.1' is configured differently: grad_hadamard=True on ranks "
            "[0-1, 3], False on ranks [2]. Give every rank the same QCommConfig") in text, text


def test_modules_on_some_ranks_only_are_named():
    fewer = [_SAME[1], _SAME[2]]
    text = agreement.verdict(_world(_SAME, fewer, _SAME, _SAME))
    assert ("they install on different FSDP modules: ['layers.0'] on ranks [0, 2-3] only, "
            "none on ranks [1] only (module_filter_fn or module_configs") in text, text


def test_the_same_configuration_with_other_plans_is_refused():
    """Replicas or peers whose groups span nodes differently would gather differently: HSDP
    replicas would then compute with different weights."""
    other = [_SAME[0], _entry("layers.1", 1, _SDP4, reference=False), _SAME[2]]
    text = agreement.verdict(_world(_SAME, _SAME, _SAME, other))
    assert "FSDP module 'layers.1' has the same configuration but other planned" in text, text


def test_meshes_of_other_ranks_are_not_compared():
    """Pipeline stages: each stage's mesh holds its own modules; only a mesh's members must
    agree on it."""
    stage0, stage1 = ((0, 1), (2,), ("dp",)), ((2, 3), (2,), ("dp",))
    first = [_entry("layers.0", 0, _SDP4, stage0), _entry("<root>", 1, _SDP4, stage0)]
    second = [_entry("layers.1", 0, _SDP4.replace(weight_bits=3), stage1),
              _entry("<root>", 1, _SDP4, stage1)]
    assert agreement.verdict(_world(first, first, second, second)) is None
    text = agreement.verdict(_world(first, first, second, second[1:]))
    assert "over ranks [2-3]" in text and "['layers.1'] on ranks [2] only" in text, text


def test_buckets_are_compared_once_every_mesh_agrees():
    """A module left out on another mesh shifts every later RNG bucket; the error names that
    module, not the first shifted bucket."""
    dense, experts = ((0, 1), (2,), ("dp",)), ((0, 1), (2,), ("efsdp",))
    full = [_entry("layers.0", 0, _SDP4, dense), _entry("layers.0.moe", 1, _SDP4, experts),
            _entry("layers.1", 2, _SDP4, dense), _entry("layers.1.moe", 3, _SDP4, experts),
            _entry("<root>", 4, _SDP4, dense)]
    fewer = [_entry("layers.0", 0, _SDP4, dense),
             _entry("layers.1", 1, _SDP4, dense), _entry("layers.1.moe", 2, _SDP4, experts),
             _entry("<root>", 3, _SDP4, dense)]
    assert repr(dense) < repr(experts)  # the dense mesh is looked at first
    text = agreement.verdict(_world(full, fewer))
    assert "the device mesh (efsdp=2) over ranks [0-1]" in text, text
    assert "['layers.0.moe'] on ranks [0] only, none on ranks [1] only" in text, text
    shifted = [_entry("layers.1", 0, _SDP4, dense), _entry("layers.0", 1, _SDP4, dense)]
    text = agreement.verdict(_world(shifted[::-1], shifted))
    assert "same FSDP modules in another order" in text, text


def test_unused_patterns_are_refused_only_where_no_rank_uses_them():
    """A module_configs pattern that chose nothing on any rank is refused on every rank; under
    pipeline parallelism (meshes over part of the world) another stage may hold its modules."""
    def world(*unused, meshes):
        return [agreement.payload([_entry("<root>", 0, _SDP4, m)], u, f"typo {u}")
                for u, m in zip(unused, meshes)]

    whole = [_MESH] * 4
    assert agreement.verdict(world(["blok.*"], ["blok.*"], ["blok.*"], ["blok.*"],
                                   meshes=whole)) == "typo ['blok.*']"
    assert agreement.verdict(world([], [], [], [], meshes=whole)) is None
    stages = [((0, 1), (2,), ("dp",))] * 2 + [((2, 3), (2,), ("dp",))] * 2
    assert agreement.verdict(world(["output"], ["output"], [], [], meshes=stages)) is None
    assert agreement.verdict(world(["out"], ["out"], ["out"], ["out"], meshes=stages)) is None


def test_a_failure_on_one_rank_is_named_to_every_rank():
    """What the others raise (``collectives.agreement``; the 2-rank run below raises it)."""
    text = agreement.STOPPED([2], 4, "ValueError: bad group")
    assert text == ("fsdp_qcomm.enable() failed on rank(s) [2] of 4, so it stops on every rank "
                    "(none trains alone). Rank 2: ValueError: bad group"), text


def test_ranks_text_names_runs():
    assert ranks_text([3, 0, 1, 2, 7, 9, 10]) == "[0-3, 7, 9-10]"
    many = ranks_text(list(range(0, 40, 2)))
    assert many == "[0, 2, 4, 6, 8, 10, 12, 14, ... (20 ranks)]", many


class _Theirs(internals.AllGather):
    """Someone else's all-gather hook, never called."""

    def allocate(self, *a, **k):
        raise AssertionError("not reached")

    def __call__(self, *a, **k):
        raise AssertionError("not reached")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def _defaults(model: nn.Module) -> bool:
    return all(internals.is_default_comm(c) for m in model.modules()
               if isinstance(m, internals.FSDPModule)
               for g in internals.param_groups(m) for c in internals.installed_comms(g))


def _attempts(rank: int, world: int) -> dict:
    """Three refused calls in a row, then one that agrees and trains: the ranks stay in step."""
    cfg = QCommConfig.preset("sdp4bit", ranks_per_node=1)
    cases = {
        "hadamard": lambda m: fsdp_qcomm.enable(
            m, cfg if rank == 0 else cfg.replace(grad_hadamard=False)),
        "filter": lambda m: fsdp_qcomm.enable(
            m, cfg, module_filter_fn=lambda mod, fqn: not (rank == 1 and fqn == "0")),
        "one_rank_fails": lambda m: (rank == 0 and m[0].set_custom_all_gather(_Theirs()),
                                     fsdp_qcomm.enable(m, cfg)),
    }
    out = {}
    for name, call in cases.items():
        model = _model()
        try:
            call(model)
            out[name] = "no error"
        except (ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        out[f"{name}_untouched"] = _defaults(model) if name != "one_rank_fails" else \
            _defaults(model[2])
    model = _model()
    handle = fsdp_qcomm.enable(model, cfg)
    loss = model(torch.ones(4, 16)).square().mean()
    loss.backward()
    out["after"] = (float(loss), handle.stats()["weight_allgather"]["calls"])
    dist.barrier()
    return out


def test_ranks_given_different_settings_refuse_alike_and_stay_in_step():
    """Before: the Hadamard case trained (each rank decoding the other's gradients with the
    wrong rotation), the filter case aborted both ranks in gloo, and the one-rank failure left
    rank 1 waiting in its first collective."""
    r0, r1 = run_ranks(_attempts, 2, timeout=300)
    for r in (r0, r1):
        assert r["hadamard"].startswith("ValueError: fsdp_qcomm.enable(): the ranks of the "
                                        "device mesh of shape 2 over ranks [0-1]"), r["hadamard"]
        assert ("FSDP module '0' is configured differently: grad_hadamard=True on ranks [0], "
                "False on ranks [1].") in r["hadamard"], r["hadamard"]
        assert "['0'] on ranks [0] only, none on ranks [1] only" in r["filter"], r["filter"]
        assert r["hadamard_untouched"] and r["filter_untouched"] and r["one_rank_fails_untouched"]
    assert r0["one_rank_fails"].startswith(
        "ValueError: FSDP module '0' already runs its all-gather through _Theirs"), r0
    assert r1["one_rank_fails"].startswith(
        "RuntimeError: fsdp_qcomm.enable() failed on rank(s) [0] of 2, so it stops on every "
        "rank (none trains alone). Rank 0: ValueError: FSDP module '0' already runs its "
        "all-gather through _Theirs"), r1
    assert r0["after"] == r1["after"] and r0["after"][1] > 0, (r0["after"], r1["after"])
