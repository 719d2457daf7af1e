"""Static instruction mix of the codec's Triton kernels on a GPU target, without a GPU.

Compiles each kernel of ``benchmarks/gpu_kernels_bench.py``'s rows the way a launch on that
GPU specializes it (pointers and integer arguments divisible by 16, the code's own launch
options and tiles), disassembles the cubin with the ``cuobjdump`` shipped in the triton wheel,
and prints per kernel: SASS instructions, those of the main path (all but the subroutines
after the last ``EXIT``: the IEEE division's slow path) per element a thread holds and how
many of them are conversions (``CONVERT``: they issue at a fraction of the others' rate),
registers, shared memory, and the memory and cross-lane instructions (global loads/stores,
shared memory, shuffles, barriers). One row that no GPU benchmark has, 4-bit with nearest
rounding, shows what the stochastic rows spend on the counter-hash random numbers.

What it is for: the kernels run at 0.12-0.77x of ``torch.clone``'s bandwidth on the H200
(``results/gpu_check/h200_2026-12-04``) because they spend too many instructions per element,
and a change to them can be weighed on any machine. What it is not: a speed. The count is
static: a loop (a large group's sub-tiles; before 2026-12-05 also the reduce kernels' loop over
received chunks, now unrolled for the k in the row's name) is counted once, and the IEEE
division's rarely taken slow path is counted in full. Compare versions of the same kernel with
it; take speeds with ``gpu_kernels_bench.py`` on a GPU.

    python benchmarks/kernel_sass.py [--arch 90] [--src CHECKOUT] [--only SUBSTRING]
        [--tile T] [--out results/kernel_sass] [--label NAME]

``--src`` compiles another checkout's kernels (an earlier commit's ``git worktree``), so a
change can be compared with what it replaces.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _provenance  # noqa: E402

#: instruction classes reported besides the total (SASS opcode prefixes)
MEMORY = ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "SHFL", "BAR")
#: conversions (float <-> int, float rounding) and special functions: on compute capability
#: 8.x-9.0 the CUDA C++ Programming Guide's throughput table gives type conversions and MUFU
#: 16 results per clock per SM against 128 for fp32 adds and multiplies, so each costs the issue
#: time of several ordinary instructions (I2FP, sm_86's int-to-float, is counted with them;
#: whether it issues faster, only a GPU profile says)
CONVERT = ("F2I", "I2F", "I2FP", "F2F", "F2FP", "FRND", "I2I", "MUFU")
F32, BF16 = "float32", "bfloat16"  # scale dtypes
#: integer arguments that are multiples of 16 at the benchmark's sizes (Triton specializes them)
_DIV16 = ("n", "m", "x_stride", "r_stride", "W", "WS", "G", "nblk", "W_in", "WS_in", "G_in",
          "out_stride", "chunk_b", "chunk_s")


@dataclass(frozen=True)
class Case:
    name: str  # as in gpu_kernels_bench.py
    module: str
    kernel: str
    ptrs: dict
    const: dict
    tile: int  # elements one program holds


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    p.add_argument("--src", type=Path, default=ROOT, help="checkout whose kernels to compile")
    p.add_argument("--only", default="", help="kernels whose name contains this")
    p.add_argument("--out", type=Path, default=None, help="results folder (table and json)")
    p.add_argument("--label", default="", help="name of this checkout in the output files")
    p.add_argument("--tile", type=int, default=0,
                   help="elements per program (a power of 2 >= 256; default: the kernels' own)")
    return p.parse_args(argv)


def _cases(C) -> list[Case]:
    from fsdp_qcomm.config import QuantSpec

    def q(bits, sym, sdt, gs, prefix=""):
        """A spec as the kernels' constexprs ``BITS, QMAX, SYM, SKIND, GS``."""
        spec = QuantSpec(bits=bits, group_size=gs, symmetric=sym, scale_dtype=sdt)
        return C.RowLayout.of(gs, spec).constexprs(prefix)

    def tiling(gs):
        gs_p2, gpb, sub = C.group_tiling(gs)
        return dict(GS_P2=gs_p2, GPB=gpb, SUB=sub), gpb * sub

    def words(spec):  # the scale section as integers of the scale's width
        return "*i32" if spec["SKIND"] == 0 else "*i16"

    # the tile the encoders choose (a checkout before 2026-12-05 has one: --src)
    flat_tile = getattr(C, "flat_tile", lambda bits, hadamard: False)

    def quant(name, spec, x="*fp32", ref=False, had=False, stoch=True, ordered=False):
        t, tile = tiling(spec["GS"])
        return Case(name, "quantize", "_quantize_kernel",
                    {"x_ptr": x, "r_ptr": x, "out_b": "*u8", "out_s": words(spec),
                     "src_rows": "*i32" if ordered else x},
                    dict(**spec, **t, STOCH=stoch, HAS_REF=ref, HADAMARD=had,
                         FLAT=flat_tile(spec["BITS"], had), ORDERED=ordered), tile)

    def dequant(name, spec, out="*fp32", had=False, acc=False):
        return Case(name, "dequantize", "_dequantize_kernel",
                    {"data_b": "*u8", "data_s": words(spec), "out_ptr": out},
                    dict(**spec, BLK8=C.TILE // 8, HADAMARD=had, ACCUMULATE=acc), C.TILE)

    def segments(name, kernel, spec, aligned, x="*fp32", base=False):
        ptrs = {"seg_tab": "*i64", "blk_seg": "*i32"}
        if kernel == "quantize":
            t, tile = tiling(spec["GS"])
            return Case(name, "quantize", "_quantize_segments_kernel",
                        {"x_ptr": x, "r_ptr": x, "out_b": "*u8", "out_s": words(spec),
                         "h3": "i64", "bucket": "i64", "salt": "i64", **ptrs},
                        dict(**spec, **t, STOCH=True, HAS_REF=True, HADAMARD=False,
                             FLAT=flat_tile(spec["BITS"], False), ALIGNED=aligned), tile)
        return Case(name, "dequantize", "_dequantize_segments_kernel",
                    {"data_b": "*u8", "data_s": words(spec), "out_ptr": x, "base_ptr": x,
                     **ptrs},
                    dict(**spec, BLK8=C.TILE // 8, HADAMARD=False, ACCUMULATE=True,
                         ALIGNED=aligned, BASE=base), C.TILE)

    def levels_quant(name, spec):
        t, tile = tiling(spec["GS"])
        return Case(name, "levels", "_quantize_levels_kernel",
                    {"x_ptr": "*fp32", "lv_ptr": "*fp32", "out_b": "*u8", "out_s": words(spec),
                     "out_l": "*fp32"}, dict(**spec, **t, STOCH=True), tile)

    def levels_dequant(name, spec, out="*fp32", acc=False):
        return Case(name, "levels", "_decode_levels_kernel",
                    {"data_b": "*u8", "data_s": words(spec), "data_l": "*fp32", "out_ptr": out},
                    dict(**spec, BLK8=C.TILE // 8, ACCUMULATE=acc), C.TILE)

    t128, tile128 = tiling(128)

    def requant(k):
        return Case(f"reduce_requantize k={k} 8b->4b g128", "reduce_requantize",
                    "_reduce_requantize_kernel",
                    {"in_b": "*u8", "in_s": "*i32", "out_b": "*u8", "out_s": "*i32"},
                    dict(**q(8, True, F32, 128, "I_"), **q(4, True, F32, 128), **t128,
                         STOCH=True, K=k),
                    tile128)

    return [
        quant("quantize 4b g128 sym stoch", q(4, True, F32, 128)),
        quant("quantize 4b g128 sym nearest", q(4, True, F32, 128), stoch=False),
        quant("quantize 8b g128 sym stoch +H32", q(8, True, F32, 128), had=True),
        quant("quantize 8b g128 sym stoch +H32, rows reordered (gradient hop 1)",
              q(8, True, F32, 128), had=True, ordered=True),
        quant("quantize 4b g128 sym stoch +H32", q(4, True, F32, 128), had=True),
        # the gradient encoders as they read FSDP's bf16 gradients
        quant("quantize 4b g128 sym stoch +H32 bf16 in", q(4, True, F32, 128), x="*bf16",
              had=True),
        quant("quantize 8b g128 sym stoch +H32, rows reordered (gradient hop 1), bf16 in",
              q(8, True, F32, 128), x="*bf16", had=True, ordered=True),
        quant("quantize 4b g2048 sym stoch x-ref (qWD)", q(4, True, F32, 2048), ref=True),
        quant("quantize 8b g1024 asym stoch bf16 in", q(8, False, BF16, 1024), x="*bf16"),
        segments("quantize_segments 4b g2048 x-ref (9 segments)", "quantize",
                 q(4, True, F32, 2048), True),
        dequant("dequantize 4b g2048 += fp32 (qWD)", q(4, True, F32, 2048), acc=True),
        segments("dequantize_segments 4b g2048 += fp32 (9 segments)", "dequantize",
                 q(4, True, F32, 2048), True),
        segments("dequantize_segments 4b g2048 += fp32 (9 odd segments)", "dequantize",
                 q(4, True, F32, 2048), False),
        # qWD as training runs it: bf16 weights, shards of whole 8-blocks or not
        segments("quantize_segments 4b g2048 x-ref bf16 (9 segments)", "quantize",
                 q(4, True, F32, 2048), True, "*bf16"),
        segments("quantize_segments 4b g2048 x-ref bf16, odd (no GPU row)", "quantize",
                 q(4, True, F32, 2048), False, "*bf16"),
        segments("dequantize_segments 4b g2048 += bf16 (9 segments)", "dequantize",
                 q(4, True, F32, 2048), True, "*bf16"),
        segments("dequantize_segments 4b g2048 += bf16 (9 segments), own row into its reference",
                 "dequantize", q(4, True, F32, 2048), True, "*bf16", base=True),
        segments("dequantize_segments 4b g2048 += bf16, odd (no GPU row)", "dequantize",
                 q(4, True, F32, 2048), False, "*bf16"),
        dequant("dequantize 8b g1024 asym -> bf16", q(8, False, BF16, 1024), out="*bf16"),
        dequant("dequantize 8b g128 +H32^-1 -> fp32", q(8, True, F32, 128), had=True),
        requant(8),
        requant(1),  # the bandwidth table's diagnostic row: one chunk, the same output
        Case("reduce_dequantize k=4 4b g128 +H32^-1", "reduce_dequantize",
             "_reduce_dequantize_kernel", {"data_b": "*u8", "data_s": "*i32", "out_ptr": "*fp32"},
             dict(**q(4, True, F32, 128), BLK8=C.TILE // 8, HADAMARD=True, K=4, DIVIDE=0),
             C.TILE),
        Case("reduce_dequantize k=4 4b g128 +H32^-1 /4 (AVG)", "reduce_dequantize",
             "_reduce_dequantize_kernel", {"data_b": "*u8", "data_s": "*i32", "out_ptr": "*fp32",
                                           "divisor": "fp32"},
             dict(**q(4, True, F32, 128), BLK8=C.TILE // 8, HADAMARD=True, K=4, DIVIDE=1),
             C.TILE),
        # QSDP's learned levels: a table of 2^b fp32 levels in front of each row
        levels_quant("quantize_levels 8b g1024 asym stoch (QSDP)", q(8, False, F32, 1024)),
        levels_quant("quantize_levels 4b g1024 asym stoch", q(4, False, F32, 1024)),
        levels_quant("quantize_levels 2b g2048 sym stoch (lowbit)", q(2, True, F32, 2048)),
        levels_dequant("dequantize_levels 8b g1024 -> bf16", q(8, False, F32, 1024), "*bf16"),
        levels_dequant("dequantize_levels 4b g1024 += fp32", q(4, False, F32, 1024), acc=True),
    ]


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    from triton.backends.nvidia import compiler

    tool = Path(compiler.__file__).parent / "bin" / "cuobjdump"
    if not tool.is_file():
        raise SystemExit(f"kernel_sass: {tool} is missing (this triton wheel ships no cuobjdump)")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        return subprocess.run([str(tool), *flags, str(f)], capture_output=True, text=True,
                              check=True).stdout


def _opcodes(sass: str) -> tuple[list[str], int]:
    """Opcodes of a ``cuobjdump -sass`` listing (predicates and modifiers dropped, NOPs out),
    and how many of them come before the subroutines placed after the kernel's last ``EXIT``
    (the IEEE division's slow path, called only for operands near the ends of the range)."""
    found = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    found = [(int(a, 16), o) for a, o in found if o != "NOP"]
    exits = [a for a, o in found if o == "EXIT"]
    main = sum(1 for a, _ in found if exits and a <= exits[-1]) if exits else len(found)
    return [o for _, o in found], main


def conversions(ops: list[str]) -> int:
    """How many of ``ops`` are conversions or special functions (``CONVERT``)."""
    return sum(o in CONVERT for o in ops)


def measure(case: Case, arch: int) -> dict:
    """Compile one case for sm_<arch> and count its SASS."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    C = importlib.import_module("fsdp_qcomm.kernels._common")
    fn = getattr(importlib.import_module(f"fsdp_qcomm.kernels.{case.module}"), case.kernel)
    const = {k: v for k, v in case.const.items() if k in fn.arg_names}  # as --src's kernels
    sig = {a: case.ptrs.get(a, "constexpr" if a in const else "i32") for a in fn.arg_names}
    div16 = [a for a in fn.arg_names if case.ptrs.get(a, "").startswith("*") or a in _DIV16]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    opts = C.launch_opts(case.tile)
    compiled = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=opts)
    dump = _cuobjdump(compiled.asm["cubin"], "--dump-resource-usage", "-sass")
    ops, main = _opcodes(dump)
    res = dict(re.findall(r"\b(REG|SHARED|LOCAL):(\d+)", dump))
    per_thread = case.tile / (32 * opts["num_warps"])
    counts = collections.Counter(ops)
    return {
        "kernel": case.name, "instructions": len(ops), "main_path": main,
        "per_element": round(main / per_thread, 1), "elements_per_thread": per_thread,
        "registers": int(res.get("REG", 0)), "shared_bytes": int(res.get("SHARED", 0)),
        "spill_bytes": int(res.get("LOCAL", 0)),
        "memory": {k: counts[k] for k in MEMORY},
        "conversions_per_element": round(conversions(ops[:main]) / per_thread, 1),
        "top": counts.most_common(8),
    }


def _table(rows: list[dict], arch: int) -> str:
    head = ("| kernel | SASS (main path) | main path per element | of them conversions | regs | "
            "shared B | " + " | ".join(MEMORY) + " |\n|" + "---|" * (6 + len(MEMORY)) + "\n")
    body = "".join(
        f"| {r['kernel']} | {r['instructions']} ({r['main_path']}) | {r['per_element']} | "
        f"{r['conversions_per_element']} | {r['registers']} | "
        f"{r['shared_bytes']} | " + " | ".join(str(r["memory"][k]) for k in MEMORY) + " |\n"
        for r in rows)
    return f"sm_{arch}, static counts (see the module docstring)\n\n{head}{body}"


def main(argv=None) -> int:
    a = _args(argv)
    import triton

    rec = _provenance.record(a.out, notes=f"triton {triton.__version__} ({sys.executable})") \
        if a.out else None
    sys.path.insert(0, str(a.src.resolve()))

    import fsdp_qcomm.kernels as K

    src = Path(K.__path__[-1]).resolve()
    print(f"kernel_sass: kernels from {src}, triton {triton.__version__}, sm_{a.arch}")
    C = sys.modules["fsdp_qcomm.kernels._common"]
    if a.tile:
        if a.tile < 256 or a.tile & (a.tile - 1):
            raise SystemExit(f"kernel_sass: --tile {a.tile}: must be a power of 2 >= 256")
        C.TILE = a.tile  # group_tiling and the element-tiled kernels read them at call time
        C.GROUP_TILE = a.tile  # (a --src checkout before it had one tile for both)
    rows = [measure(c, a.arch) for c in _cases(C) if a.only in c.name]
    if not rows:
        raise SystemExit(f"kernel_sass: no kernel name contains {a.only!r}")
    tiles = f"TILE {C.TILE}, GROUP_TILE {getattr(C, 'GROUP_TILE', C.TILE)}"
    table = f"triton {triton.__version__}, {tiles}; " + _table(rows, a.arch)
    print(table)
    if a.out:
        label = a.label or "kernels"
        (a.out / f"{label}.md").write_text(f"kernels: {src}\n{table}")
        (a.out / f"{label}.json").write_text(json.dumps(
            {"src": str(src), "triton": triton.__version__, "arch": a.arch, "tile": C.TILE,
             "group_tile": getattr(C, "GROUP_TILE", C.TILE),
             "rows": rows},
            indent=1) + "\n")
        rec.note(label=label, src=str(src))
    return 0


if __name__ == "__main__":
    sys.exit(main())
