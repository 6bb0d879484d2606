"""What the kernels keep for the backward: no saved activation is a view into a larger buffer (megatron's k and v are
views of the fused QKV output; keeping them as given held the whole buffer until the backward: 4 hidden sizes per
token and layer for Qwen3-0.6B where k and v are 2), on Qwen3 (k norm) and Llama (no q/k norm), TP1 and TP2."""

import pytest
import torch

from loongforge_hf.kernels._saved import needs_autograd, standalone, training_numerics
from loongforge_hf.kernels.rmsnorm import rms_norm
from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint


def _views_kept(run, exclude=frozenset()) -> list:
    """Shapes and storage sizes of the tensors autograd keeps while ``run`` runs that are views into a larger
    storage (storages in ``exclude`` left out)."""
    kept = []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude and storage.nbytes() > t.numel() * t.element_size():
            kept.append((tuple(t.shape), storage.nbytes() // t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return kept


def test_standalone_copies_only_views_of_larger_storage():
    fused = torch.randn(5, 2, 12)
    k = fused[..., 4:8]
    assert standalone(fused) is fused
    copy = standalone(k)
    assert copy is not k and torch.equal(copy, k) and copy.is_contiguous()
    assert copy.untyped_storage().nbytes() == k.numel() * k.element_size()
    head = fused[:2]  # contiguous, yet a slice of a larger storage
    assert standalone(head) is not head and torch.equal(standalone(head), head)


def test_training_numerics_takes_the_autograd_path_without_grad(monkeypatch):
    """Under ``training_numerics`` a no-grad call takes the kernels' training path (rms_norm's autograd function),
    nested or not, and the flag is restored after (also after an error)."""
    from loongforge_hf.kernels import rmsnorm

    calls = []
    forward = rmsnorm._RMSNormFunction.forward
    monkeypatch.setattr(rmsnorm._RMSNormFunction, "forward",
                        staticmethod(lambda ctx, *args: calls.append(1) or forward(ctx, *args)))
    x, w = torch.randn(3, 8, requires_grad=True), torch.rand(8, requires_grad=True)
    with torch.no_grad():
        assert not needs_autograd(x, w)
        rms_norm(x, w, 1e-6)
        assert not calls
        with training_numerics():
            with training_numerics():
                assert needs_autograd(x) and needs_autograd(None)
            assert needs_autograd(x, w)
            y = rms_norm(x, w, 1e-6)
        assert not needs_autograd(x, w) and calls == [1] and not y.requires_grad
    assert torch.equal(y, rms_norm(x, w, 1e-6).detach())
    with pytest.raises(RuntimeError, match="inside"):
        with training_numerics():
            raise RuntimeError("inside")
    with torch.no_grad():
        assert not needs_autograd(x, w)


def test_rms_norm_keeps_its_own_copy_of_a_view():
    fused = torch.randn(6, 3, 16, requires_grad=True)
    weight = torch.randn(4, requires_grad=True)
    # a view of a non-leaf, as megatron's k is of the QKV projection output
    run = lambda: rms_norm((fused * 1).view(6, 3, 4, 4)[:, :, 1], weight).sum()  # noqa: E731
    assert _views_kept(run) == []
    x = (fused * 1).view(6, 3, 4, 4)[:, :, 1]
    out = rms_norm(x, weight)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = rms_norm(ref_x, weight)
    g = torch.randn_like(out)
    assert torch.equal(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, ref_x, g)[0])


def _saved_views(folders: dict) -> dict:
    import loongforge_hf as lf

    kept = {}
    for arch, folder in folders.items():
        for tp in (1, 2):  # on two ranks: DP2 with whole layers, then TP2
            model = lf.AutoModelForCausalLM.from_pretrained(folder, tensor_parallel_size=tp, dtype=torch.float32)
            ids = torch.randint(4, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
            # the weights the linears keep (as given or as transposed views) are not activations
            weights = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())
            kept[f"{arch} tp{tp}"] = _views_kept(lambda: model(input_ids=ids, labels=ids).loss.backward(), weights)
    return kept


def test_decoder_layers_keep_no_view_of_a_larger_buffer(tmp_path):
    folders = {arch: str(make_tiny_checkpoint(tmp_path / arch, arch, tokenizer=False)) for arch in ("qwen3", "llama")}
    for rank in run_distributed(_saved_views, 2, folders, timeout=300):
        assert rank == {f"{arch} tp{tp}": [] for arch in folders for tp in (1, 2)}, rank


def test_norm_copy_input_keeps_a_copy():
    """``RMSNorm.copy_input`` (set for the first layer under megatron's local CUDA graphs, whose input buffer does not
    outlive the forward): the norm keeps a copy of its input, not the input's storage; same result."""
    from types import SimpleNamespace

    from loongforge_hf.kernels.rmsnorm import RMSNorm

    config = SimpleNamespace(normalization="RMSNorm", layernorm_zero_centered_gamma=False, use_cpu_initialization=True,
                             params_dtype=torch.float32, sequence_parallel=False)
    norm = RMSNorm(config, hidden_size=8)
    x = torch.randn(3, 2, 8, requires_grad=True)
    plain = norm(x)
    norm.copy_input = True
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        copied = norm(x)
    assert torch.equal(copied, plain)
    assert all(t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for t in kept)
    assert any(t.shape == x.shape for t in kept)
