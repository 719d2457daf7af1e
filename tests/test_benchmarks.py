"""Benchmark helpers that must fail clearly or count exactly (no ranks, no network, < 5 s)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _model  # noqa: E402
import cluster_speed  # noqa: E402


def test_rate_parsing_and_refusal():
    assert cluster_speed._rate_bps("1gbit") == 1e9
    assert cluster_speed._rate_bps("100mbit") == 1e8
    assert cluster_speed._rate_bps("2.5gbit") == 2.5e9
    with pytest.raises(ValueError, match="100mbit, 1gbit"):
        cluster_speed._rate_bps("1gbps")


def test_missing_data_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data"):
        _model.CharData(str(tmp_path / "nope.txt"))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ValueError, match="at least 10000"):
        _model.CharData(str(short))


def test_chardata_jsonl_split_and_batches(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join('{"text": "%s"}' % ("hello world " * 20) for _ in range(100)))
    d = _model.CharData(str(f))
    assert len(d.train) + len(d.val) == len("\n".join(["hello world " * 20] * 100))
    x, y = d.batch("train", 4, 16, seed=1, step=3, rank=2)
    x2, y2 = d.batch("train", 4, 16, seed=1, step=3, rank=2)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # same batch for every scheme
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert not torch.equal(x, d.batch("train", 4, 16, seed=1, step=3, rank=1)[0])


def test_param_count_matches_model():
    shape = _model.GPTShape(vocab=65, dim=64, layers=3, heads=4, seq=32)
    model = _model.GPT(shape)
    assert shape.params() == sum(p.numel() for p in model.parameters())
