"""Qwen3-Next and Qwen3.5-MoE's text model (Qwen3.5's Gated DeltaNet and gated full-attention layers with a mixture of
experts and a gated shared expert) beyond the shared suites: sequences across several of the delta rule's chunks with
left padding (logits, loss and transformers' balancing loss, which weighs the router by the attention mask), packed
documents, generate without and with the cache; fp32 against transformers within 1e-4 (1e-5 for the balancing loss).
Their layouts, round trips and gradients run in test_moe_parity / test_gradients, their refusals in test_bad_input.
Both models run in one one-rank world (megatron sets process environment variables when it builds a model)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
AUX_TOL = 1e-5
ARCHS = ("qwen3_next", "qwen3_5_moe")
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
    # NOTE: 150 tokens (three chunks of the delta rule), the second row left-padded by 9
    ids = _ids((2, 150))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    labels = ids.masked_fill(mask == 0, -100)
    kw = dict(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    with torch.no_grad():
        got, want = ours(**kw), ref(**kw)
    out["padded"] = {"logits": float((got.logits - want.logits).abs()[mask.bool()].max()),
                     "loss": abs(got.loss.item() - want.loss.item()),
                     "aux": abs(got.aux_loss.item() - want.aux_loss.item()), "aux_value": want.aux_loss.item()}
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
    # NOTE: greedy generate of a left-padded batch of two, without and with the cache (states of both mixers)
    ids = _ids((2, 9), seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    for name, use_cache in (("uncached", False), ("cached", True)):
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=use_cache,
                  return_dict_in_generate=True, output_scores=True)
        got, want = ours.generate(**kw), ref.generate(**kw)
        out[name] = (torch.equal(got.sequences, want.sequences),
                     max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
    return out


def _each(folders: dict) -> dict:
    return {arch: _checks(folder) for arch, folder in folders.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next")
    folders = {arch: str(make_tiny_checkpoint(root / arch, arch)) for arch in ARCHS}
    return run_distributed(_each, 1, folders, timeout=300)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_long_sequences_left_padding_and_balancing_loss(results, arch):
    r = results[arch]["padded"]
    assert r["logits"] < TOL and r["loss"] < TOL, r
    assert r["aux"] < AUX_TOL and r["aux_value"] > 0.1, r


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_documents_restart_the_recurrence(results, arch):
    """Documents of 7, 20 and 11 tokens packed in a row give each document's logits as transformers gives them for
    the document alone."""
    assert max(results[arch]["packed"]) < TOL, results[arch]["packed"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ("uncached", "cached"))
def test_generate_left_padded_batch(results, arch, mode):
    same, scores = results[arch][mode]
    assert same and scores < TOL, results[arch][mode]
