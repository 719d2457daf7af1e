"""``fsdp_qcomm.kernels`` imports from a bare checkout, an editable install and a built wheel,
and nothing of ours is a top-level ``kernels`` package (Hugging Face's ``kernels``, which
``transformers`` imports, must not be shadowed by a checkout on ``sys.path``).

Each check runs in a fresh interpreter: ``-S`` (no site-packages processing, so no editable
install's import hook) with an explicit ``PYTHONPATH`` of the location under test followed by
the site-packages that hold torch and triton.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_MODULES = sorted(p.stem for p in (ROOT / "kernels").glob("*.py"))
# What a fresh clone holds that the package needs (tracked files only: no build outputs).
_CHECKOUT = ("fsdp_qcomm", "kernels", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md",
             "LICENSE")


def _site_dirs() -> list[str]:
    """Where torch, triton and the other requirements are installed in this environment."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def _python(code: str, path: list[str], cwd: Path, bare: bool = True,
            site_dirs: bool = True) -> str:
    """Run ``code`` in a fresh interpreter with ``path`` first on sys.path; returns stdout.
    ``bare``: skip site (no .pth hooks such as an editable install's finder), but keep the
    site-packages directories on the path unless ``site_dirs`` is false."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join(path + (_site_dirs() if bare and site_dirs else [])),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, *(["-S"] if bare else []), "-c", code]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{code}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the repository's package files, as a fresh clone has them."""
    dst = tmp_path_factory.mktemp("checkout")
    for name in _CHECKOUT:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    return dst


_IMPORT_KERNELS = """
import sys, importlib.util
import fsdp_qcomm.kernels as k
mods = {m: sys.modules["fsdp_qcomm.kernels." + m].__file__ for m in %r}
print(k.__file__)
for m, f in sorted(mods.items()):
    print(m, f)
print("top-level kernels:", importlib.util.find_spec("kernels"))
assert callable(k.quantize) and callable(k.quantize_levels)
"""


def _check_kernels_from(out: str, package_dir: Path, sources: Path) -> None:
    lines = out.splitlines()
    assert Path(lines[0]) == package_dir / "__init__.py", lines[0]
    for line, name in zip(lines[1:], [m for m in KERNEL_MODULES if not m.startswith("__")]):
        mod, f = line.split(" ", 1)
        assert mod == name and Path(f) == sources / f"{name}.py", line


def test_kernels_import_from_a_bare_checkout_on_pythonpath(checkout, tmp_path):
    out = _python(_IMPORT_KERNELS % KERNEL_MODULES, [str(checkout)], cwd=tmp_path)
    _check_kernels_from(out, checkout / "fsdp_qcomm" / "kernels", checkout / "kernels")


def test_kernels_import_from_the_editable_install(tmp_path):
    dists = list(md.distributions(name="fsdp-qcomm"))
    if not any('"editable": true' in (d.read_text("direct_url.json") or "") for d in dists):
        pytest.skip("fsdp-qcomm is not installed in editable mode in this environment")
    out = _python(_IMPORT_KERNELS % KERNEL_MODULES, [], cwd=tmp_path, bare=False)
    pkg = Path(out.splitlines()[0]).parent
    if pkg.parents[1] != ROOT:
        pytest.skip(f"the editable install points at another checkout ({pkg.parents[1]})")
    _check_kernels_from(out, ROOT / "fsdp_qcomm" / "kernels", ROOT / "kernels")


@pytest.fixture(scope="module")
def wheel(checkout, tmp_path_factory) -> Path:
    """One wheel built from the checkout (no network needed when setuptools is installed)."""
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-q", "-w",
           str(out), str(checkout)]
    try:  # pyproject needs setuptools>=69; without it pip builds in an isolated environment
        if int(md.version("setuptools").split(".")[0]) >= 69:
            cmd.insert(4, "--no-build-isolation")
    except md.PackageNotFoundError:
        pass
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("fsdp_qcomm-*.whl")
    return whl


def test_wheel_holds_the_kernels_inside_the_package_and_no_top_level_kernels(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if "/" in n}
    assert tops == {"fsdp_qcomm", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for m in KERNEL_MODULES:
        assert f"fsdp_qcomm/kernels/{m}.py" in names, m
    assert "fsdp_qcomm/kernels/__init__.py" in names
    assert "fsdp_qcomm/codec/cpu_native.c" in names


def test_kernels_import_from_an_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                           "--no-compile", "-q", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = _python(_IMPORT_KERNELS % KERNEL_MODULES, [str(target)], cwd=tmp_path)
    pkg = target / "fsdp_qcomm" / "kernels"
    _check_kernels_from(out, pkg, pkg)


def test_no_top_level_kernels_package_of_ours(checkout, tmp_path):
    """With the checkout first on sys.path, ``kernels`` is at most an empty namespace portion:
    any regular ``kernels`` package later on sys.path wins, and none of our modules imports
    under that name. Site-packages stays off the path: the environment may hold a regular
    ``kernels`` of its own (transformers installs Hugging Face's), which would win here too."""
    code = """
import importlib, importlib.util
spec = importlib.util.find_spec("kernels")
print(spec.origin, list(spec.submodule_search_locations))
import kernels
print(sorted(n for n in vars(kernels) if not n.startswith("__")))
try:
    importlib.import_module("kernels.quantize")
    print("imported")
except ImportError as e:
    print("ImportError")
"""
    out = _python(code, [str(checkout)], cwd=tmp_path, site_dirs=False).splitlines()
    assert out[0] == f"None {[str(checkout / 'kernels')]}"  # a namespace portion, no __init__
    assert out[1] == "[]" and out[2] == "ImportError"
    other = tmp_path / "other" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("FROM = 'another distribution'\n")
    code = "import kernels; print(kernels.FROM, kernels.__file__)"
    out = _python(code, [str(checkout), str(other.parent)], cwd=tmp_path, site_dirs=False)
    assert out.strip() == f"another distribution {other / '__init__.py'}"


@pytest.mark.long
def test_transformers_loads_a_model_with_the_checkout_on_sys_path(checkout, tmp_path):
    """What a user does from the repository root (``python -c``, ``-m`` or ``PYTHONPATH``): a
    tiny GPT-2 is built from a config, saved, loaded back offline and run, next to our kernels."""
    pytest.importorskip("transformers")
    code = f"""
import sys, torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config
cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=16)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg).eval()
model.save_pretrained({str(tmp_path / 'gpt2')!r})
loaded = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'gpt2')!r}).eval()
ids = torch.arange(12).view(2, 6)
a = model(input_ids=ids, labels=ids).loss
b = loaded(input_ids=ids, labels=ids).loss
assert torch.isfinite(a) and torch.equal(a, b), (a, b)
import fsdp_qcomm.kernels
print("kernels", transformers.utils.import_utils.is_kernels_available(), float(a))
"""
    out = _python(code, [str(checkout)], cwd=checkout)
    try:
        md.version("kernels")  # Hugging Face's kernels installed: it must be the one found
        hf_kernels = True
    except md.PackageNotFoundError:
        hf_kernels = False
    assert out.startswith(f"kernels {hf_kernels} "), out
