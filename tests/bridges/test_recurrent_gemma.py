"""RecurrentGemmaForCausalLM (Griffin's RG-LRU recurrent blocks and local MQA attention) against transformers, fp32
within 1e-4, on a tiny model with recurrent layers 0, 1, 3 and an attention layer 2 (a window of 8 that binds):
- the RG-LRU kernel (``kernels/rg_lru.py``) against transformers' ``RecurrentGemmaRglru`` (output and every gradient,
  resets inside the rows), no world;
- TP1 (one world): logits and loss; left padding and packed documents against transformers running each row /
  document alone (transformers' own block takes no mask: its padding enters the conv and the scan); cached greedy
  (a left-padded batch against each prompt alone) and beam search against transformers'; a bit-exact export round
  trip;
- two ranks (one world): TP2 + SP logits and loss, left padding against each row alone, every parameter's gradient
  exported through the bridge against transformers'; PP2 (two layers a stage) logits and loss, left padding; CP2
  (the conv's halo and the RG-LRU's states passed between the chunks) with packed documents and left padding
  against each alone: logits, loss, every parameter's gradient;
- refusals on the bridge alone (pure, before any collective), naming the field."""

import re

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
PAD = 9  # NOTE: the second row's left padding


def _ids(shape, seed=0):
    return torch.randint(4, 203, shape, generator=torch.Generator().manual_seed(seed))


def _models(folder: str, **layout):
    import transformers

    import loongforge_hf as lf

    return (lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout),
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


def _plain(ours, ref) -> dict:
    ids = _ids((2, 30), seed=1)
    with torch.no_grad():
        got, want = ours(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids, use_cache=False)
    return {"logits": float((got.logits - want.logits).abs().max()), "loss": float(abs(got.loss - want.loss))}


def _padded(ours, ref) -> dict:
    """Two rows of 40 tokens, the second left-padded by ``PAD``: its real tokens' logits against transformers' run of
    them alone, the first row's against its run; the loss (labels from the second real token on) against the loss of
    those logits."""
    import torch.nn.functional as F

    ids = _ids((2, 40))
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    labels = ids.clone()
    labels[1, :PAD + 1] = -100
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask, labels=labels)
        want = torch.zeros_like(got.logits)
        want[0] = ref(input_ids=ids[:1], use_cache=False).logits[0]
        want[1, PAD:] = ref(input_ids=ids[1:, PAD:], use_cache=False).logits[0]
    loss = F.cross_entropy(want[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    return {"logits": float((got.logits - want).abs()[mask.bool()].max()), "loss": float(abs(got.loss - loss))}


def _generate(ours, ref) -> dict:
    """Cached greedy generate of a left-padded batch of two (the second prompt 3 tokens shorter; the first 10 tokens,
    past the window of 8) against transformers' (with its cache) of each prompt alone; cached 2-beam search against
    transformers' without its cache (its cached one keeps the recurrent states in its modules, which no beam
    reordering reaches: its scores drift from its own uncached ones by 0.7 here)."""
    ids = _ids((2, 10), seed=3)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    got = ours.generate(input_ids=ids, attention_mask=mask, **kw)
    alone = [ref.generate(input_ids=ids[i:i + 1, 3 * i:], **kw) for i in range(2)]
    out = {"greedy": (all(torch.equal(got.sequences[i, 3 * i:], a.sequences[0]) for i, a in enumerate(alone)),
                      max(float((a[i] - b[0]).abs().max()) for i, one in enumerate(alone)
                          for a, b in zip(got.scores, one.scores)))}
    got, want = ours.generate(input_ids=ids, num_beams=2, **kw), ref.generate(input_ids=ids, num_beams=2,
                                                                              use_cache=False, **kw)
    out["beam"] = (torch.equal(got.sequences, want.sequences),
                   max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
    return out


def _gradients(ours, ref, folder: str) -> dict | None:
    """Every parameter's gradient after a backward (rank 0: relative to each tensor's largest; None elsewhere)."""
    import torch.distributed as dist

    from ._gradients import gradient_diffs, save_gradients

    ids = _ids((2, 24), seed=2)
    ours(input_ids=ids, labels=ids).loss.backward()
    save_gradients(ours, f"{folder}-grads")
    if dist.get_rank() != 0:
        return None
    ref.zero_grad()
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return gradient_diffs(f"{folder}-grads", ref)


def _cp2(ours, ref, folder: str) -> dict:
    """CP2 (four chunks of 38 tokens): a row packing documents of ``CP_LENGTHS`` (starts at a chunk's first token,
    inside chunks, one spanning a chunk's end) and a row left-padded by ``PAD``, labels ignored on padding, on each
    row's first real token and across documents. Against transformers running each document and the padded row's
    real tokens alone: the logits, the loss and every parameter's gradient (reduced over CP as megatron's DDP,
    exported through the bridge; relative to each tensor's largest, rank 0); an uncached greedy generate (a 6-token
    prompt padded to 8: chunks of 2, shorter than the conv) against transformers' tokens and scores."""
    import torch.distributed as dist

    from ._gradients import gradient_diffs, save_gradients
    from .test_qwen3_5 import CP_LENGTHS

    ref.zero_grad(set_to_none=True)
    ids = _ids((2, 152), seed=4)
    positions = torch.stack([torch.cat([torch.arange(n) for n in CP_LENGTHS]), (torch.arange(152) - PAD).clamp(0)])
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    labels = ids.masked_fill(positions == 0, -100)
    got = ours(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels)
    got.loss.backward()
    starts = [sum(CP_LENGTHS[:i]) for i in range(len(CP_LENGTHS))]
    parts = [(0, a, a + n) for a, n in zip(starts, CP_LENGTHS)] + [(1, PAD, 152)]
    results = [ref(input_ids=ids[r:r + 1, a:b], labels=labels[r:r + 1, a:b], use_cache=False) for r, a, b in parts]
    counts = [int((labels[r, a + 1:b] != -100).sum()) for r, a, b in parts]
    (sum(res.loss * n for res, n in zip(results, counts)) / sum(counts)).backward()
    out = {"logits": max(float((got.logits[r, a:b] - res.logits[0]).abs().max()) for (r, a, b), res in
                         zip(parts, results)),
           "loss": abs(got.loss.item() - sum(res.loss.item() * n for res, n in zip(results, counts)) / sum(counts))}
    ids, kw = _ids((1, 6), seed=3), dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                                         output_scores=True)
    got, want = ours.generate(input_ids=ids, use_cache=False, **kw), ref.generate(input_ids=ids, **kw)
    out["generate"] = (torch.equal(got.sequences, want.sequences),
                       max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
    save_gradients(ours, f"{folder}-cp2-grads")
    if dist.get_rank() == 0:
        out["grads"] = gradient_diffs(f"{folder}-cp2-grads", ref)
    return out


def _one_rank(folder: str) -> dict:
    import tempfile

    from loongforge_hf.testing.round_trip import check_round_trip

    from .test_qwen3_5 import packed_against_alone

    ours, ref = _models(folder)
    out = {"plain": _plain(ours, ref), "padded": _padded(ours, ref), "packed": packed_against_alone(ours, ref),
           "generate": _generate(ours, ref)}
    with tempfile.TemporaryDirectory() as saved:
        ours.save_pretrained(saved)
        check_round_trip(folder, saved)
        out["round_trip"] = True
    return out


def _two_ranks(folder: str) -> dict:
    import loongforge_hf as lf

    ours, ref = _models(folder, tensor_parallel_size=2, sequence_parallel=True)
    out = {"plain": _plain(ours, ref), "padded": _padded(ours, ref), "grads": _gradients(ours, ref, folder)}
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2)
    out["pp2"] = {"plain": _plain(ours, ref), "padded": _padded(ours, ref)}
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    out["cp2"] = _cp2(ours, ref, folder)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("recurrent_gemma") / "rg", "recurrent_gemma"))


@pytest.fixture(scope="module")
def one_rank(folder):
    return run_distributed(_one_rank, 1, folder, timeout=300)[0]


@pytest.fixture(scope="module")
def two_ranks(folder):
    return run_distributed(_two_ranks, 2, folder, timeout=300)


def test_rg_lru_against_transformers():
    """The kernel's gates, normalised input and scan (resets at a row's first token and inside the rows) against
    transformers' ``RecurrentGemmaRglru``: output and the gradients of the input and of every parameter."""
    import transformers
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    from loongforge_hf.kernels.rg_lru import rg_lru

    torch.manual_seed(0)
    theirs = RecurrentGemmaRglru(transformers.RecurrentGemmaConfig(hidden_size=24, num_attention_heads=3))
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    x = torch.randn(2, 13, 24, requires_grad=True)
    positions = torch.tensor([list(range(13)), [*range(5), *range(8)]])
    want = theirs(x, positions)
    got, _ = rg_lru(x, reset=positions == 0, **dict(theirs.named_parameters()))
    assert float((got - want).abs().max()) < 1e-6
    grad = torch.randn_like(want)
    theirs_grads = torch.autograd.grad(want, [x, *theirs.parameters()], grad)
    our_grads = torch.autograd.grad(got, [x, *theirs.parameters()], grad)
    for a, b in zip(our_grads, theirs_grads):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), (a, b)


def test_one_rank(one_rank):
    for name in ("plain", "padded"):
        assert one_rank[name]["logits"] < TOL and one_rank[name]["loss"] < TOL, (name, one_rank[name])
    assert max(one_rank["packed"]) < TOL, one_rank["packed"]
    for name in ("greedy", "beam"):
        same, scores = one_rank["generate"][name]
        assert same and scores < TOL, (name, one_rank["generate"])
    assert one_rank["round_trip"]


def test_tp2_sequence_parallel_and_pp2(two_ranks):
    for name in ("plain", "padded"):
        for res in (two_ranks[0], two_ranks[0]["pp2"], two_ranks[1]["pp2"]):
            assert res[name]["logits"] < TOL and res[name]["loss"] < TOL, (name, res[name])
    grads = two_ranks[0]["grads"]
    assert len(grads) > 40 and max(grads.values()) < 1e-4, sorted(grads.items(), key=lambda kv: -kv[1])[:5]


def test_context_parallel_padded_and_packed(two_ranks):
    """CP2: packed documents (one starting at a chunk's first token, one spanning a chunk's end) and a left-padded
    row against transformers running each alone: logits and loss on both ranks, every parameter's gradient (the
    recurrent blocks' conv, gates and ``recurrent_param``, the local attention, the MLPs, the norms); an uncached
    greedy generate (chunks shorter than the conv) against transformers'."""
    for rank, res in enumerate(two_ranks):
        assert res["cp2"]["logits"] < TOL and res["cp2"]["loss"] < TOL, (rank, res["cp2"])
        same, scores = res["cp2"]["generate"]
        assert same and scores < TOL, (rank, res["cp2"]["generate"])
    grads = two_ranks[0]["cp2"]["grads"]
    assert len(grads) == len(two_ranks[0]["grads"]) and any("recurrent_param" in n for n in grads), sorted(grads)
    assert max(grads.values()) < 1e-4, sorted(grads.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("changes, layout, field", [
    ({}, dict(tensor_parallel_size=8), "num_attention_heads=4 (the RG-LRU's heads) does not split over "
                                       "tensor_parallel_size=8"),
    ({"block_types": ["recurrent", "mlp"]}, None, "block_types ['recurrent', 'mlp'] is not supported"),
    ({"hidden_activation": "gelu"}, None, "hidden_activation='gelu' is not supported"),
    ({"lru_width": 66}, None, "lru_width=66 does not split into num_attention_heads=4")])
def test_refused(folder, changes, layout, field):
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig

    config = transformers.AutoConfig.from_pretrained(folder)
    for name, value in changes.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        get_bridge(config).check_layout(ParallelConfig(**(layout or {})))


def test_static_cache_refused(folder):
    """The static cache's fixed-shape decode step keeps no conv / RG-LRU state: refused by name (pure), the dynamic
    cache taken."""
    import transformers

    from loongforge_hf.bridges import get_bridge

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folder))
    refusal = bridge.generation_refusal(transformers.GenerationConfig(use_cache=True, cache_implementation="static"))
    assert refusal and "cache_implementation='static' is not supported for RecurrentGemmaForCausalLM" in refusal
    assert bridge.generation_refusal(transformers.GenerationConfig(use_cache=True)) is None
