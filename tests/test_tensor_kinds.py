"""Native code (the C loops, Triton kernels) gets a tensor's memory only after the tensor proves
it is a plain strided tensor that owns what it addresses (``codec._checks.raw_memory_ok``);
every other kind users bring takes the torch path. Before, torchao's float8 weights (a wrapper
subclass whose ``data_ptr()`` is not its data) were digested in C and killed every rank with
SIGSEGV before the first forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _models import train_step

import fsdp_qcomm
from fsdp_qcomm import QCommConfig, QuantSpec, RngKey
from fsdp_qcomm.codec import cpu_native, quantize, torch_codec
from fsdp_qcomm.codec._checks import raw_memory_ok
from fsdp_qcomm.fsdp.change_tracker import _torch_digest, shard_digests
from fsdp_qcomm.testing import run_ranks

SPEC = QuantSpec(bits=4, group_size=32)
KEY = RngKey(1, 2, 3, 4)


def _torchao():
    try:  # torchao's CPU parts; a build for another torch may fail to load
        import torchao.float8 as f8
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torchao.float8 does not import here: {e}")
    return f8


def test_plain_tensors_views_and_strides_may_go_native():
    x = torch.randn(6, 40)
    assert raw_memory_ok("cpu", x, x[1:3], x[:, 3:], x.t(), nn.Parameter(x.clone()), None)
    assert raw_memory_ok("cpu", torch.empty(0))


def test_other_kinds_may_not():
    x = torch.randn(8, 16)
    freed = torch.randn(8)
    freed.untyped_storage().resize_(0)  # what FSDP2 does to an unsharded parameter's storage
    assert not raw_memory_ok("cpu", freed)
    assert not raw_memory_ok("cuda", x)  # another device
    assert not raw_memory_ok("cpu", torch.empty(4, device="meta"))
    assert not raw_memory_ok("cpu", x.to_sparse())

    class Wrapper(torch.Tensor):  # any subclass, even one that keeps real storage
        pass

    assert not raw_memory_ok("cpu", x.as_subclass(Wrapper))


def _dtensor_run(rank: int, world: int) -> tuple[bool, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (world,))
    d = DTensor.from_local(torch.randn(4, 8), mesh, [Replicate()])
    return raw_memory_ok("cpu", d), raw_memory_ok("cpu", d.to_local())


def test_dtensor_and_its_local_shard():
    assert run_ranks(_dtensor_run, 2) == [(False, True)] * 2


def test_torchao_float8_weight_takes_the_torch_path_with_the_same_value():
    f8 = _torchao()
    m = nn.Sequential(nn.Linear(32, 64))
    f8.convert_to_float8_training(m, config=f8.Float8LinearConfig(
        enable_fsdp_float8_all_gather=True))
    w = m[0].weight
    assert hasattr(w, "fsdp_pre_all_gather") and not raw_memory_ok("cpu", w)
    flat = w.detach().reshape(-1)
    assert cpu_native.digest(flat, 0) is None  # C declines it; the torch formula runs
    inner = w._tensor.detach().reshape(-1)
    assert torch.equal(shard_digests([[flat]])[0], _torch_digest([inner]))
    # the codec too: the torch implementation, the same bytes as for the plain values
    rows = w.detach().reshape(2, -1)
    plain_rows = w._tensor.detach().reshape(2, -1)
    assert torch.equal(quantize(rows, SPEC, KEY), torch_codec.quantize(plain_rows, SPEC, KEY))


def test_torchao_nf4_tensor_is_not_native():
    _torchao()
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    t = nf4.to_nf4(torch.randn(256, 256))
    assert not raw_memory_ok("cpu", t)


def _float8_run(rank: int, world: int, preset: str) -> dict:
    import torchao.float8 as f8
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(),
                          nn.Linear(32, 16))
    f8.convert_to_float8_training(model, config=f8.Float8LinearConfig(
        enable_fsdp_float8_all_gather=True))
    for i in (0, 2):
        fully_shard(model[i])
    fully_shard(model)
    handle = None
    if preset != "fsdp2":
        handle = fsdp_qcomm.enable(model, QCommConfig.preset(preset, quantize_intra_node=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)
        loss = F.mse_loss(model(x), y)
        losses.append(train_step(loss, opt))
    out = {"losses": losses}
    if handle is not None:
        stats = handle.stats()
        out["kinds"] = {k: v["calls"] for k, v in stats.items()
                        if isinstance(v, dict) and "calls" in v}
        out["modes"] = dict(handle.gather_modes())
        handle.disable()
    return out


@pytest.mark.parametrize("preset", ["sdp4bit", "qsdp", "bf16"])
def test_float8_all_gather_trains_with_gradients_quantized(preset):
    """torchao's float8 all-gather: its 8-bit payload is gathered as it sends itself, the
    gradient reduction is quantized, and no rank dies (it did: SIGSEGV in the C digest)."""
    _torchao()
    base = run_ranks(_float8_run, 2, "fsdp2")[0]
    got = run_ranks(_float8_run, 2, preset)
    assert got[0]["losses"] == got[1]["losses"]
    assert got[0]["losses"][0] == base["losses"][0]  # the first forward precedes any reduction
    assert all(abs(a - b) < 0.05 * b for a, b in zip(got[0]["losses"], base["losses"]))
    assert any(k.startswith("grad") for k in got[0]["kinds"]), got[0]
    assert set(got[0]["modes"]) <= {"plain"}, got[0]["modes"]  # float8 payload not re-quantized


def _float64_run(rank, world, preset, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12)).double()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[
        -len(mesh_shape):])
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = fsdp_qcomm.enable(model, QCommConfig.preset(preset, ranks_per_node=1)) \
        if preset != "fsdp2" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 12, generator=g)
        losses.append(train_step(F.mse_loss(model(x.double()), y.double()), opt))
    out = {"losses": losses}
    if handle is not None:
        out["notes"] = handle.stats().get("notes", [])
        handle.disable()
    return out


@pytest.mark.parametrize("preset", ["sdp4bit", "qsdp", "bf16"])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["fsdp", "hsdp"])
def test_float64_parameters_train_as_fsdp2_does(preset, mesh_shape):
    """float64 parameters (a numerics check, a scientific model): the codec takes 16- and
    32-bit values, so their gathers and reductions stay FSDP's own, exact in float64, each
    with a note; the first backward raised TypeError before."""
    world = 1
    for n in mesh_shape:
        world *= n
    base = run_ranks(_float64_run, world, "fsdp2", mesh_shape)[0]
    for r in run_ranks(_float64_run, world, preset, mesh_shape):
        assert r["losses"] == base["losses"], (r["losses"], base["losses"])
        notes = " ".join(r["notes"])
        if preset != "bf16":  # whose gathers of other dtypes are FSDP's anyway
            assert "weight all-gather fell back" in notes and "torch.float64" in notes, notes
        assert "reduce-scatter fell back" in notes, notes
