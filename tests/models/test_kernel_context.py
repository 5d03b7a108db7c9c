"""A model load's KernelContext: the one object its layers' kernels read this machine's tuning from
(set once, after loading, on what was loaded), which the attention backend is handed too."""
from __future__ import annotations

import pytest
import torch

from pagellm.attention.torch_ref import TorchReferenceBackend
from pagellm.config import EXACT_LINEAR
from pagellm.kernels import ops
from pagellm.kernels.tuning import F32_PANELS, CpuTuning, RowLimits
from pagellm.layers.linear_method import PACKED_MAX_ROWS, DenseMethod
from pagellm.models.loader import default_model_path, load_hf_config, load_model

pytestmark = pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")


def test_the_tuning_set_on_the_loads_context_reaches_every_layer_and_the_backend() -> None:
    from pagellm.attention.cpu_paged import CpuPagedBackend

    path = default_model_path()
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), TorchReferenceBackend(), EXACT_LINEAR)
    methods = [layer.method for _, layer in model.linear_layers()]
    panels = [m for m in methods if isinstance(m, DenseMethod) and m.panels is not None]
    assert panels and all(method.kernels is model.kernels for method in panels)
    assert model.kernels.pack_session is None  # only during the load
    assert all(method.packed_max_rows == PACKED_MAX_ROWS for method in panels)  # untuned until measured

    model.kernels.tuning = CpuTuning(decode_prefetch_to_l2=True, row_limits=((F32_PANELS, RowLimits(8)),))
    assert all(method.packed_max_rows == 8 for method in panels)
    backend = CpuPagedBackend()
    assert not backend.decode_prefetch_to_l2
    backend.use_kernel_context(model.kernels)
    assert backend.decode_prefetch_to_l2
