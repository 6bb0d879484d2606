"""Device backend selection: explicit choices that cannot work raise and name what is missing."""

import pytest
import torch

from loongforge_hf.xpu import available_backends, get_backend
from loongforge_hf.xpu import registry


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    registry._reset_for_tests()
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    yield
    registry._reset_for_tests()


def test_default_is_cuda_when_available_else_cpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert get_backend().name == expected
    assert "cpu" in available_backends()


def test_env_var_selects_and_unknown_names_are_listed(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "cpu")
    assert get_backend().name == "cpu" and get_backend().dist_backend == "gloo"
    registry._reset_for_tests()
    monkeypatch.setenv(registry.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match="Unknown device backend 'tpu'.*cpu, cuda, kunlun"):
        get_backend()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_explicit_cuda_without_gpu_names_what_is_missing():
    with pytest.raises(RuntimeError, match="torch.cuda.is_available\\(\\) is False"):
        get_backend("cuda")


def test_explicit_kunlun_without_its_stack_names_the_packages():
    with pytest.raises(RuntimeError, match="torch_xmlir.*xpu_plugin|Kunlun"):
        get_backend("kunlun")


def test_cpu_backend_patches_are_in_place():
    get_backend("cpu")
    from megatron.core.transformer import utils as tutils

    assert tutils.get_default_causal_mask(4).device.type == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu") or torch.cuda.is_available()


def test_cpu_literals_only_redirect_cuda_literals(monkeypatch):
    """megatron's literal ``device="cuda"`` goes to the CPU; a device taken from a tensor stays where CUDA works (the
    patch is process-wide: a CUDA tensor given to megatron's MoE permute after the CPU backend was set up must keep
    its device), and goes to the CPU where CUDA does not."""
    from loongforge_hf.xpu.cpu import _literal_on_cpu

    assert _literal_on_cpu("cuda") == "cpu" and _literal_on_cpu("cuda:1") == "cpu"
    assert _literal_on_cpu("cpu") == "cpu" and _literal_on_cpu(None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _literal_on_cpu(torch.device("cuda", 0)) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _literal_on_cpu(torch.device("cuda", 0)) == "cpu"
    get_backend("cpu")
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.torch.arange(3, device="cuda").device.type == "cpu"
    assert moe_utils.torch.arange(3, device=torch.device("cpu")).device.type == "cpu"


def test_cpu_backend_answers_device_questions():
    """What kernels ask instead of calling torch.cuda themselves (kernels/_triton.py, kernels/fp8_linear.py)."""
    from loongforge_hf.xpu.cpu import CpuBackend

    backend = CpuBackend()
    calls = []
    assert backend.device_name() == "cpu" and backend.compute_capability() is None
    assert backend.multiprocessor_count() >= 1
    assert backend.time_ms(lambda: calls.append(1), reps=3) >= 0 and len(calls) == 3


def test_backends_without_device_graphs_say_so():
    """What the static KV cache asks before capturing its decode step (static_cache.py): the CPU backend has no
    device graphs; running before a capture is one plain call, and a capture is refused, not faked."""
    from loongforge_hf.xpu.cpu import CpuBackend
    from loongforge_hf.xpu.cuda import CudaBackend

    backend = CpuBackend()
    calls = []
    assert not backend.supports_graphs and CudaBackend.supports_graphs
    assert backend.run_before_capture(lambda: calls.append(1) or "out") == "out" and calls == [1]
    with pytest.raises(NotImplementedError, match="no device graphs"):
        backend.capture(lambda: calls.append(2))
    assert calls == [1]


def test_stream_capturing_asks_the_backend_of_the_device_type():
    """``stream_capturing(device)`` (what the small-input kernel paths ask, ``kernels._triton.launch_bound``) goes to
    the backend class registered for the device's type, whichever backend the process runs; a backend without
    device graphs, or a device type no backend claims, is never capturing."""
    from loongforge_hf.xpu import stream_capturing
    from loongforge_hf.xpu.cpu import CpuBackend
    from loongforge_hf.xpu.cuda import CudaBackend

    assert registry._backend_class("cpu") is CpuBackend and registry._backend_class("cuda") is CudaBackend
    assert registry._backend_class("meta") is registry.Backend
    assert stream_capturing(torch.device("cpu")) is False and stream_capturing(torch.device("meta")) is False
