"""Stream and lifetime rules of the hooks that can be checked without a GPU
(``docs/gpu_path.md``): an asynchronous weight gather waited on another CUDA stream than the one
it was launched on marks its buffers as used by the waiting stream."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_qcomm.collectives import weight_gather as wg


class _Buffer:
    """Stands for a CUDA tensor: records ``record_stream`` calls."""

    is_cuda = True
    device = "cuda:0"

    def __init__(self) -> None:
        self.recorded: list[object] = []

    def record_stream(self, stream: object) -> None:
        self.recorded.append(stream)


class _Inner(dist.Work):
    def __init__(self) -> None:
        super().__init__()
        self.waited = 0

    def wait(self, timeout=None) -> bool:
        self.waited += 1
        return True


def _deferred(monkeypatch, launch: str, wait: str):
    streams = iter([launch, wait])
    monkeypatch.setattr(wg, "_current_stream", lambda bufs: next(streams))
    bufs = (_Buffer(), _Buffer())
    calls = []
    work = wg._DeferredWork(_Inner(), lambda: calls.append("decode"), bufs)
    return work, bufs, calls


def test_wait_on_another_stream_records_the_buffers_on_it(monkeypatch):
    work, bufs, calls = _deferred(monkeypatch, "side", "compute")
    assert work.wait() and calls == ["decode"]
    assert [b.recorded for b in bufs] == [["compute"], ["compute"]]
    assert work.wait() and calls == ["decode"]  # once only
    assert work.is_completed()


def test_wait_on_the_launch_stream_needs_no_record(monkeypatch):
    work, bufs, calls = _deferred(monkeypatch, "compute", "compute")
    work.wait()
    assert calls == ["decode"] and [b.recorded for b in bufs] == [[], []]


def test_cpu_buffers_have_no_stream():
    assert wg._current_stream((torch.zeros(2),)) is None
    assert wg._current_stream(()) is None
