"""A model load with the packed-weight cache: the second load of the default GGUF maps every panel
the first packed (no pack runs), and computes the same logits bit for bit."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from model_utils import PagedDriver

from pagellm.attention.torch_ref import TorchReferenceBackend
from pagellm.config import EXACT_LINEAR, LinearPrecision
from pagellm.kernels import ops, pack_cache
from pagellm.models.loader import default_model_path, load_hf_config, load_model

pytestmark = pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198, 1, 4093, 198, 19556, 17, 2]
INT8 = LinearPrecision(kind="int8", fallback="bfloat16")
PACK_OPS = ("pack_weight_int8", "pack_weight_bf16", "pack_weight", "pack_weight_gate_up")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGELLM_PACKED_WEIGHT_CACHE", str(tmp_path))
    return tmp_path


def count_packs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in PACK_OPS:
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    return calls


def load(precision: LinearPrecision, cache: bool = True) -> torch.nn.Module:
    path = default_model_path()
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), TorchReferenceBackend(), precision, cache)
    pack_cache.wait_for_writes()
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    driver = PagedDriver(model, load_hf_config(default_model_path()), block_size=16, num_blocks=8)
    with torch.no_grad():
        return torch.cat([driver.step([(0, PROMPT[:-1])]), driver.step([(0, PROMPT[-1:])])])


def panels(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for _, layer in model.linear_layers():
        method = layer.method
        out.append(method.panels if hasattr(method, "panels") else method.packed)
    return out


@pytest.mark.parametrize("precision", [INT8, EXACT_LINEAR], ids=["int8", "float32"])
def test_the_second_load_maps_the_first_loads_panels(cache_dir: Path, precision: LinearPrecision, monkeypatch: pytest.MonkeyPatch) -> None:
    if precision is INT8 and not ops.int8_matmul_available():
        pytest.skip("no int8 dot products in this build")
    calls = count_packs(monkeypatch)
    first = load(precision)
    packed_calls = len(calls)
    assert packed_calls > 0
    [path] = cache_dir.glob("*.pack")
    second = load(precision)
    assert len(calls) == packed_calls  # nothing packed the second time
    for a, b in zip(panels(first), panels(second)):
        assert torch.equal(a, b)
        assert b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert torch.equal(logits(first), logits(second))
    assert second.weight_bytes() == first.weight_bytes()
    assert path.stat().st_size >= sum(t.nbytes for t in panels(second) if t is not None)


def test_a_changed_checkpoint_is_packed_again(
    cache_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy of the default model stands for the user's file, touched between the loads.
    copy = tmp_path_factory.mktemp("model") / "model.gguf"
    copy.write_bytes(Path(default_model_path()).read_bytes())
    calls = count_packs(monkeypatch)

    def load_copy() -> None:
        load_model(str(copy), load_hf_config(str(copy)), torch.float32, torch.device("cpu"), TorchReferenceBackend(), EXACT_LINEAR, True)
        pack_cache.wait_for_writes()

    load_copy()
    once = len(calls)
    load_copy()
    assert len(calls) == once
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    load_copy()
    assert len(calls) == 2 * once
    assert len(list(cache_dir.glob("*.pack"))) == 1  # one file for the checkpoint, rewritten


def test_no_file_without_the_cache(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load(EXACT_LINEAR, cache=False)
    assert list(cache_dir.iterdir()) == []
    monkeypatch.setenv("PAGELLM_PACKED_WEIGHT_CACHE", "0")
    load(EXACT_LINEAR, cache=True)
    assert list(cache_dir.iterdir()) == []
