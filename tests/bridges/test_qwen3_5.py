"""Qwen3.5 (Gated DeltaNet and gated full-attention layers) beyond the shared parity suites: sequences across several
of the delta rule's chunks, packed documents, left padding, uncached generate and the refused KV cache; fp32 against
transformers within 1e-4 (the layouts, round trips and gradients run in test_dense_parity / test_gradients). The
models run in a one-rank world (megatron sets process environment variables when it builds a model)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
LENGTHS = (7, 20, 11)  # NOTE: the packed row's documents


def _ids(shape, seed=0):
    return torch.randint(4, 203, shape, generator=torch.Generator().manual_seed(seed))


def _checks(folder: str) -> dict:
    """Each test's numbers, ours against transformers' on the same inputs."""
    import transformers

    import loongforge_hf as lf

    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    # NOTE: 150 tokens (three chunks of the delta rule: the state crosses chunks), the second row left-padded by 9
    ids = _ids((2, 150))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    with torch.no_grad():
        got, want = ours(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits
    out["padded"] = float((got - want).abs()[mask.bool()].max())
    # NOTE: a packed row (position ids restarting at 0) against each document alone
    ids = _ids((1, sum(LENGTHS)), seed=1)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=positions).logits[0]
        start, out["packed"] = 0, []
        for n in LENGTHS:
            alone = ref(input_ids=ids[:, start:start + n]).logits[0]
            out["packed"].append(float((packed[start:start + n] - alone).abs().max()))
            start += n
    ids = _ids((1, 6), seed=2)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    got = ours.generate(input_ids=ids, use_cache=False, **kw)
    want = ref.generate(input_ids=ids, **kw)
    out["generate"] = (torch.equal(got.sequences, want.sequences),
                       max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
    try:
        ours.generate(input_ids=ids, max_new_tokens=2)
        out["cache_refusal"] = None
    except ValueError as e:
        out["cache_refusal"] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5") / "src", "qwen3_5")
    return run_distributed(_checks, 1, str(folder), timeout=300)[0]


def test_long_sequences_and_left_padding(results):
    """150 tokens (three chunks of the delta rule: the state crosses chunks) with the second row left-padded by 9."""
    assert results["padded"] < TOL, results["padded"]


def test_packed_documents_restart_the_recurrence(results):
    """A row packing documents of 7, 20 and 11 tokens (position ids restarting at 0) gives each document's logits as
    transformers gives them for the document alone (the conv and the state restart; transformers' torch fallback
    would run on across documents, its fla kernels restart as we do)."""
    assert max(results["packed"]) < TOL, results["packed"]


def test_generate_without_cache_and_the_cache_refused(results):
    same, scores = results["generate"]
    assert same and scores < TOL, results["generate"]
    assert results["cache_refusal"] is not None and "Qwen3_5ForCausalLM generates without a cache only" in \
        results["cache_refusal"] and "use_cache=False" in results["cache_refusal"], results["cache_refusal"]
