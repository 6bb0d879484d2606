"""Qwen3.5 (Gated DeltaNet and gated full-attention layers) beyond the shared parity suites: sequences across several
of the delta rule's chunks, packed documents, left padding, uncached generate and the refused KV cache; fp32 against
transformers within 1e-4 (the layouts, round trips and gradients run in test_dense_parity / test_gradients)."""

import pytest
import torch

from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    import loongforge_hf as lf

    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5") / "src", "qwen3_5")
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, ref


def _ids(shape, seed=0):
    return torch.randint(4, 203, shape, generator=torch.Generator().manual_seed(seed))


def test_long_sequences_and_left_padding(models):
    """150 tokens (three chunks of the delta rule: the state crosses chunks) with the second row left-padded by 9."""
    ours, ref = models
    ids = _ids((2, 150))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    with torch.no_grad():
        got, want = ours(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits
    assert (got - want).abs()[mask.bool()].max() < TOL


def test_packed_documents_restart_the_recurrence(models):
    """A row packing documents of 7, 20 and 11 tokens (position ids restarting at 0) gives each document's logits as
    transformers gives them for the document alone (the conv and the state restart; transformers' torch fallback
    would run on across documents, its fla kernels restart as we do)."""
    ours, ref = models
    lengths = (7, 20, 11)
    ids = _ids((1, sum(lengths)), seed=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=positions).logits[0]
        start = 0
        for n in lengths:
            alone = ref(input_ids=ids[:, start:start + n]).logits[0]
            assert (packed[start:start + n] - alone).abs().max() < TOL, (start, n)
            start += n


def test_generate_without_cache_and_the_cache_refused(models):
    ours, ref = models
    ids = _ids((1, 6), seed=2)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    got = ours.generate(input_ids=ids, use_cache=False, **kw)
    want = ref.generate(input_ids=ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)) < TOL
    with pytest.raises(ValueError, match=r"Qwen3_5ForCausalLM generates without a cache only .* use_cache=False"):
        ours.generate(input_ids=ids, max_new_tokens=2)
