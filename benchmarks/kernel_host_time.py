"""Host time of the codec kernels' Python wrappers per call, the launch itself left out.

Before each launch a wrapper checks its inputs, works out the row layout and builds the
launch's arguments, on the host, once per codec call in the hooks. On a GPU that time adds to
the step wherever the host, not the device, is the bottleneck (the hooks' host time nearly
doubles from W=8 to W=64: ``docs/gpu_path.md`` section 7). This replaces every Triton kernel
of the wrappers with a launch that does nothing and times the wrappers on CPU tensors, so it
runs on any machine and compares checkouts (``--src``). Not included: Triton's own launcher
and CUDA allocations, which need a GPU.

    python benchmarks/kernel_host_time.py [--src CHECKOUT] [--repeat 25] [--number 300]
        [--out results/kernel_host_time --label NAME]

Each figure is the best of ``--repeat`` timings of ``--number`` calls (microseconds per call):
the least-disturbed run, as ``timeit`` recommends on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _provenance  # noqa: E402


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=ROOT, help="checkout whose kernels to time")
    p.add_argument("--repeat", type=int, default=25)
    p.add_argument("--number", type=int, default=300)
    p.add_argument("--out", type=Path, default=None, help="results folder (table and json)")
    p.add_argument("--label", default="", help="name of this checkout in the output files")
    return p.parse_args(argv)


class _NoLaunch:
    """A Triton kernel whose launch ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches(kernels) -> int:
    """Replace the Triton kernels of every module of the package ``kernels``; how many."""
    from triton.runtime.jit import JITFunction

    count = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith(kernels.__name__ + "."):
            for attr, value in list(vars(mod).items()):
                if isinstance(value, JITFunction) and attr.endswith("_kernel"):
                    setattr(mod, attr, _NoLaunch())
                    count += 1
    return count


def cases(K) -> dict:
    """Calls of the wrappers on the shapes of ``gpu_kernels_bench.py``'s rows, small."""
    import torch

    from fsdp_qcomm import QuantSpec
    from fsdp_qcomm.codec import RngKey, torch_codec
    from fsdp_qcomm.codec import levels as lv

    key = RngKey(seed=1, step=2, rank=3, bucket=4)
    s4, s8 = QuantSpec(bits=4, group_size=128), QuantSpec(bits=8, group_size=128)
    w4 = QuantSpec(bits=4, group_size=2048)
    q8 = QuantSpec(bits=8, group_size=1024, symmetric=False)
    n = 1 << 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, n, generator=g)
    ref = x + 0.01
    segs = (n // 9 // 8 * 8,) * 8 + (n - 8 * (n // 9 // 8 * 8),)
    flat, flat_ref = x[0].contiguous(), ref[0].contiguous()
    seg_data = torch.cat([torch_codec.quantize(x[:, :m].contiguous(), w4, key, None, False)
                          for m in segs], 1)
    data4 = torch_codec.quantize(x, w4, key, None, False)
    k8 = torch.stack([torch_codec.quantize(x[:, :n // 8].contiguous(), s8, key.fold(j), None,
                                           False) for j in range(8)])
    k4 = torch.stack([torch_codec.quantize(x[:, :n // 4].contiguous(), s4, key.fold(j), None,
                                           True) for j in range(4)])
    table = lv.fit_levels(lv.histogram(torch.randn(4, 8192, generator=g) ** 3, q8), q8)
    lev = torch_codec.quantize_levels(x, q8, table, key)
    out = torch.zeros(8, n)
    return {
        "quantize 4b g128 sym stoch": lambda: K.quantize(x, s4, key, None, False),
        "quantize 4b g128 sym stoch +H32": lambda: K.quantize(x, s4, key, None, True),
        "quantize 4b g2048 x-ref (qWD)": lambda: K.quantize(x, w4, key, ref, False),
        "quantize_segments 4b g2048 x-ref (9 segments)":
            lambda: K.quantize_segments(flat, segs, w4, key, 1 << 40, flat_ref),
        "dequantize 4b g2048 += fp32": lambda: K.dequantize(data4, n, w4, False, out, True),
        "dequantize_segments 4b g2048 += fp32 (9 segments)":
            lambda: K.dequantize_segments(seg_data, segs, w4, False, out, True),
        "reduce_requantize k=8 8b->4b g128":
            lambda: K.reduce_requantize(list(k8.unbind(0)), n // 8, s8, s4, key),
        "reduce_dequantize k=4 4b g128 +H32^-1":
            lambda: K.reduce_dequantize(list(k4.unbind(0)), n // 4, s4, True, None),
        "quantize_levels 8b g1024 asym stoch": lambda: K.quantize_levels(x, q8, table, key),
        "dequantize_levels 8b g1024 -> fp32":
            lambda: K.dequantize_levels_sum([lev], n, q8, out, False),
    }


def main(argv=None) -> int:
    a = _args(argv)
    rec = _provenance.record(a.out) if a.out else None
    sys.path.insert(0, str(a.src.resolve()))
    import fsdp_qcomm.kernels as K

    src = Path(K.__path__[-1]).resolve()
    stubbed = stub_launches(K)
    print(f"kernel_host_time: kernels from {src}, {stubbed} launches stubbed out; "
          f"best of {a.repeat} x {a.number} calls")
    rows = []
    for name, call in cases(K).items():
        call()  # caches (layouts, segment tables)
        best = min(timeit.repeat(call, number=a.number, repeat=a.repeat)) / a.number
        rows.append({"case": name, "host_us": round(best * 1e6, 2)})
        print(f"{name:52s} {best * 1e6:7.1f} us")
    if a.out:
        label = a.label or "kernels"
        table = "| wrapper call | host us (launch stubbed) |\n|---|---|\n" + "".join(
            f"| {r['case']} | {r['host_us']:.1f} |\n" for r in rows)
        (a.out / f"{label}.md").write_text(
            f"kernels: {src}; best of {a.repeat} x {a.number} calls\n\n{table}")
        (a.out / f"{label}.json").write_text(json.dumps(
            {"src": str(src), "repeat": a.repeat, "number": a.number, "rows": rows},
            indent=1) + "\n")
        rec.note(label=label, src=str(src))
    return 0


if __name__ == "__main__":
    sys.exit(main())
