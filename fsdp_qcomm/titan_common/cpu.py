"""Run torchtitan on CPU-only hosts (gloo), without editing torchtitan (0.2.2 and 0.3 alike).

Three things stop stock torchtitan on a machine without an accelerator, and a fourth fails its exit:

1. ``torchtitan.tools.utils`` picks ``device_type = _get_available_device_type() or "cuda"``
   at import time, and several modules copy that value (and ``device_module = torch.cuda``)
   into their own globals with ``from torchtitan.tools.utils import device_type``. With
   "cuda" the trainer calls ``torch.cuda.set_device`` and dies ("Found no NVIDIA driver").
   :func:`patch_torchtitan_for_cpu` rebinds those globals to ``"cpu"`` and to
   :data:`CPU_DEVICE_MODULE`, a stand-in that provides the ``torch.cuda`` functions torchtitan
   calls (``torch.cpu`` lacks ``get_device_name``, ``get_device_properties``,
   ``memory_stats``, ...). It must run before ``Trainer.__init__`` reads ``utils.device_type``:
   the 0.2.2 adapter calls it from its ``[experimental] custom_import`` module, the 0.3 adapter
   at the top of its trainer's ``__init__``. With device_type "cpu", torchtitan's
   ``init_distributed`` picks gloo (``Backend.default_device_backend_map["cpu"]``) by itself.

2. torchtitan sets FSDP's gradient divide factor to 1.0 (its loss is already divided by the
   global token count), which FSDP2 turns into ``ReduceOp.PREMUL_SUM(1.0)``; gloo rejects
   PREMUL_SUM. ``fsdp_qcomm.enable`` (called by ``install_qcomm``) already switches such gloo
   modules, and every module with a quantized reduce-scatter and a divide factor, to
   ``set_force_sum_reduction_for_comms(True)``: FSDP then passes ``ReduceOp.SUM`` and divides
   by the factor 1.0, the same sum PREMUL_SUM(1.0) computes. Nothing here repeats that.

3. torchtitan 0.3's MoE token dispatch (expert parallelism) exchanges tokens with
   ``dist.all_to_all`` on lists of unequal tensors (each rank sends each expert group the tokens
   routed to it); gloo's list all-to-all takes equal sizes only ("ProcessGroupGloo::alltoall:
   invalid tensor size"), though its ``all_to_all_single`` takes split sizes.
   :func:`patch_torchtitan_for_cpu` installs :func:`uneven_all_to_all` in its place: on gloo
   groups with unequal tensors it runs one ``all_to_all_single`` of the flattened tensors with
   the per-peer split sizes and copies the received pieces into the output list (the same
   values; elsewhere it calls the original).

4. torch's gloo backend aborts a process at interpreter exit ("terminate called without an
   active exception") when a gloo group outlives ``destroy_process_group``
   (``docs/known_issues.md``). Stock torchtitan's ``main`` destroys the group while its trainer
   is alive; once ``main`` returns, reference cycles in the FSDP2 model keep the model, its
   device mesh and the group until teardown, where the abort kills the rank, and torchrun then
   kills rank 0 during its closing sleep, before it writes the run's summary.
   :func:`patch_torchtitan_for_cpu` registers one ``gc.collect`` at exit, which frees them
   while Python still runs.

Memory figures on CPU: ``memory_stats`` reports the process's peak resident set size
(``ru_maxrss``, which cannot be reset) as both "active" and "reserved" peak, and the host's
physical memory as capacity. MFU is meaningless on CPU (torchtitan assumes A100 peak flops).
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import platform
import resource
import sys
from types import SimpleNamespace
from typing import Any

import torch

#: Set to "cpu" to run on CPU even where an accelerator exists (tests, debugging).
FORCE_DEVICE_ENV = "FSDP_QCOMM_DEVICE"


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class _CPUDeviceModule:
    """The subset of the ``torch.cuda`` API torchtitan calls, answered for the host CPU."""

    def __getattr__(self, name: str) -> Any:  # anything else: whatever torch.cpu has
        return getattr(torch.cpu, name)

    # device selection / sync -----------------------------------------------------------
    def set_device(self, device: Any) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device: Any = None) -> None:
        pass

    # identification / memory -----------------------------------------------------------
    def get_device_name(self, device: Any = None) -> str:
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"

    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(
            name=self.get_device_name(), total_memory=_host_memory_bytes()
        )

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    @property
    def memory(self) -> SimpleNamespace:
        def unsupported(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("memory snapshots are a CUDA feature; disable "
                               "profiling.enable_memory_snapshot on CPU")

        return SimpleNamespace(_record_memory_history=unsupported, _snapshot=unsupported)


CPU_DEVICE_MODULE = _CPUDeviceModule()


def _forced() -> bool:
    return os.environ.get(FORCE_DEVICE_ENV, "").lower() == "cpu"


def cpu_fallback_needed() -> bool:
    """True where torchtitan would wrongly pick "cuda" (no accelerator) or CPU is forced."""
    if _forced():
        return True
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None


def fallback_reason() -> str:
    """Why the CPU fallback is on, for the log: forced (a GPU host may be running a CPU job on
    purpose, or by a leftover variable) or no accelerator."""
    return f"{FORCE_DEVICE_ENV}=cpu" if _forced() else "no accelerator"


class _CopyBackWork(torch.distributed.Work):
    """The ``Work`` of an async ``uneven_all_to_all``: waits, then writes the output list."""

    def __init__(self, inner: Any, finish: Any) -> None:
        super().__init__()
        self._inner, self._finish = inner, finish

    def wait(self, timeout: Any = None) -> bool:
        if self._inner is not None:
            inner, self._inner = self._inner, None
            inner.wait()
            self._finish()
        return True

    def is_completed(self) -> bool:
        return self._inner is None


def uneven_all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """``dist.all_to_all`` that also takes unequal tensors on gloo (see the module docstring)."""
    import torch.distributed as dist

    orig = _ORIGINALS["all_to_all"]
    pg = group if group is not None else dist.group.WORLD
    even = len({tuple(t.shape) for t in (*input_tensor_list, *output_tensor_list)}) == 1
    if even or dist.get_backend(pg) != "gloo":
        return orig(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
    ref = input_tensor_list[0]
    send = torch.cat([t.reshape(-1) for t in input_tensor_list]) if input_tensor_list else \
        ref.new_empty(0)
    recv = send.new_empty(sum(t.numel() for t in output_tensor_list))
    work = dist.all_to_all_single(
        recv, send, output_split_sizes=[t.numel() for t in output_tensor_list],
        input_split_sizes=[t.numel() for t in input_tensor_list], group=group,
        async_op=async_op)

    def finish() -> None:
        off = 0
        for t in output_tensor_list:
            t.copy_(recv[off:off + t.numel()].view(t.shape))
            off += t.numel()

    if async_op:
        return _CopyBackWork(work, finish)
    finish()
    return None


_ORIGINALS: dict[str, Any] = {}


def _patch_uneven_all_to_all() -> None:
    import torch.distributed as dist

    if dist.all_to_all is not uneven_all_to_all:
        _ORIGINALS.setdefault("all_to_all", dist.all_to_all)
        dist.all_to_all = uneven_all_to_all


@functools.cache
def _collect_at_exit() -> None:
    """Register the exit-time collection (item 4 above), once per process."""
    atexit.register(gc.collect)


def patch_torchtitan_for_cpu() -> bool:
    """Rebind torchtitan's device globals to the CPU; returns True if it patched anything.

    Safe to call twice. Modules imported later read the patched ``torchtitan.tools.utils``.
    """
    if not cpu_fallback_needed():
        return False
    _collect_at_exit()
    _patch_uneven_all_to_all()
    from torchtitan.tools import utils

    originals = (utils.device_type, utils.device_module)
    if utils.device_type == "cpu" and utils.device_module is CPU_DEVICE_MODULE:
        return False
    utils.device_type, utils.device_module = "cpu", CPU_DEVICE_MODULE
    for name, mod in list(sys.modules.items()):
        if not name.startswith("torchtitan.") or mod is None or mod is utils:
            continue
        if getattr(mod, "device_type", None) == originals[0] and isinstance(
            getattr(mod, "device_type", None), str
        ):
            mod.device_type = "cpu"
        if getattr(mod, "device_module", None) is originals[1]:
            mod.device_module = CPU_DEVICE_MODULE
    # A default argument captured the old value at definition time.
    from torchtitan.components import metrics

    init = metrics.DeviceMemoryMonitor.__init__
    if init.__defaults__ and init.__defaults__[0] != "cpu:0":
        init.__defaults__ = ("cpu:0",)
    return True
