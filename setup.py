"""Build hook: the Triton kernels' sources live in the top-level ``kernels/`` folder and are
installed as the modules of ``fsdp_qcomm.kernels`` (see ``fsdp_qcomm/kernels/__init__.py``).

Everything else is declared in ``pyproject.toml``. An editable install needs no copy: the
package finds the folder from the checkout.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_SRC = Path(__file__).resolve().parent / "kernels"
_DST = ("fsdp_qcomm", "kernels")


class BuildPyWithKernels(build_py):
    """``build_py`` that also copies ``kernels/*.py`` into ``fsdp_qcomm/kernels/``."""

    def _kernel_files(self) -> list[tuple[Path, Path]]:
        dst = Path(self.build_lib, *_DST)
        return [(f, dst / f.name) for f in sorted(_SRC.glob("*.py"))]

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        files = self._kernel_files()
        if not files:
            raise RuntimeError(f"no kernel sources found in {_SRC}")
        for src, dst in files:
            self.mkpath(str(dst.parent))
            self.copy_file(str(src), str(dst), preserve_mode=False)
        if self.compile or self.optimize:
            self.byte_compile([str(d) for _, d in files])

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outs = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            outs += [str(d) for _, d in self._kernel_files()]
        return outs


setup(cmdclass={"build_py": BuildPyWithKernels})
