"""Qwen3.5 (Gated DeltaNet and gated full-attention layers), and Qwen3-Next / Qwen3.5-MoE's text model (the same
layers with a mixture of experts and a gated shared expert), beyond the shared parity suites: sequences across several
of the delta rule's chunks with left padding (the MoE models' loss and transformers' balancing loss too, which weighs
the router by the attention mask), packed documents, generate without and with the cache (the Gated DeltaNets' conv
and recurrent states; greedy over a left-padded batch of two, Qwen3.5 also beam search and at TP2 with sequence
parallelism) and the refused static cache; fp32 against transformers within 1e-4 (1e-5 for the balancing loss). The
layouts, round trips and gradients run in test_dense_parity / test_moe_parity / test_gradients, the refusals in
test_bad_input. The three models run in one one-rank world (megatron sets process environment variables when it
builds a model); Qwen3.5's TP2 cached generate and its context parallelism (CP2: padding and packed documents with
logits, loss and every gradient against transformers, an uncached generate, the refused cached one) in one two-rank
world. Kimi Linear (Kimi Delta Attention's per-channel decay, NoPE MLA, experts) runs in the one-rank world too:
the long left-padded sequences (logits and loss), packed documents, greedy generate without and with the cache, and
the hub's naming of its dense MLP (``mlp``, transformers' ``block_sparse_moe``: ``checkpoint_aliases``): that folder
loads with the same logits as the ``block_sparse_moe`` one (bitwise) and transformers', and saves what transformers'
save_pretrained writes after loading it; a folder with both names reads ``block_sparse_moe``'s, as transformers
(pure)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
AUX_TOL = 1e-5
MOE_ARCHS = ("qwen3_next", "qwen3_5_moe")
INDEX = "model.safetensors.index.json"
LENGTHS = (7, 20, 11)  # NOTE: the packed row's documents
CP_LENGTHS = (38, 35, 10, 12, 57)  # NOTE: the packed row's documents under CP2 (chunks of 38 tokens)


def _ids(shape, seed=0):
    return torch.randint(4, 203, shape, generator=torch.Generator().manual_seed(seed))


def _models(folder: str):
    import transformers

    import loongforge_hf as lf

    return (lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


def _padded_and_packed(ours, ref, *, moe: bool) -> dict:
    """150 tokens (three chunks of the delta rule: the state crosses chunks), the second row left-padded by 9: the
    logits' largest difference on real tokens (MoE: and the loss's, the balancing loss's and its value); a packed row
    (position ids restarting at 0) against each document alone."""
    ids = _ids((2, 150))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kw = dict(input_ids=ids, attention_mask=mask)
    if moe:
        kw.update(labels=ids.masked_fill(mask == 0, -100), output_router_logits=True)
    with torch.no_grad():
        got, want = ours(**kw), ref(**kw)
    out = {"padded": float((got.logits - want.logits).abs()[mask.bool()].max())}
    if moe:
        out["moe"] = {"loss": abs(got.loss.item() - want.loss.item()),
                      "aux": abs(got.aux_loss.item() - want.aux_loss.item()), "aux_value": want.aux_loss.item()}
    out["packed"] = packed_against_alone(ours, ref)
    return out


def packed_against_alone(ours, ref) -> list[float]:
    """A row packing documents of ``LENGTHS`` tokens (position ids restarting at 0): each document's largest logit
    difference from transformers' run of it alone (also Granite 4.0 H's check, test_granitemoehybrid.py)."""
    ids = _ids((1, sum(LENGTHS)), seed=1)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=positions).logits[0]
        diffs, start = [], 0
        for n in LENGTHS:
            alone = ref(input_ids=ids[:, start:start + n]).logits[0]
            diffs.append(float((packed[start:start + n] - alone).abs().max()))
            start += n
    return diffs


def _checks(folder: str) -> dict:
    """Qwen3.5's numbers, ours against transformers' on the same inputs; the hub's ``mtp.*`` tensors after a save."""
    import tempfile

    from loongforge_hf.bridges.checkpoint_io import CheckpointReader

    ours, ref = _models(folder)
    out = _padded_and_packed(ours, ref, moe=False)
    with tempfile.TemporaryDirectory() as saved:
        ours.save_pretrained(saved)
        source, written = CheckpointReader(folder), CheckpointReader(saved)
        names = sorted(n for n in source.keys() if n.startswith("mtp."))
        out["mtp"] = (names, sorted(n for n in written.keys() if n.startswith("mtp.")),
                      all(torch.equal(source.get(n), written.get(n)) for n in names))
    ids = _ids((1, 6), seed=2)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    got = ours.generate(input_ids=ids, use_cache=False, **kw)
    want = ref.generate(input_ids=ids, **kw)
    out["generate"] = (torch.equal(got.sequences, want.sequences),
                       max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
    out.update(_cached_generate(ours, ref, beams=True))
    try:
        ours.generate(input_ids=ids, max_new_tokens=2, cache_implementation="static")
        out["static_refusal"] = None
    except ValueError as e:
        out["static_refusal"] = str(e)
    return out


def _moe_checks(folder: str) -> dict:
    """Qwen3-Next's / Qwen3.5-MoE's numbers: as Qwen3.5's with the losses, greedy generate without and with the
    cache."""
    ours, ref = _models(folder)
    out = _padded_and_packed(ours, ref, moe=True)
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


def _kimi_checks(folder: str) -> dict:
    """Kimi Linear's numbers: 150 tokens (three chunks) with the second row left-padded by 9 (logits on real tokens,
    the loss), packed documents against each alone, greedy generate of a left-padded batch without and with the
    cache (the KDA layers' conv and recurrent states, the MLA layer's keys)."""
    ours, ref = _models(folder)
    ids = _ids((2, 150))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    with torch.no_grad():
        got, want = ours(**kw), ref(**kw)
    out = {"padded": float((got.logits - want.logits).abs()[mask.bool()].max()),
           "loss": abs(got.loss.item() - want.loss.item()), "packed": packed_against_alone(ours, ref)}
    ids = _ids((2, 9), seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False,
              return_dict_in_generate=True, output_scores=True)
    got, want = ours.generate(**kw), ref.generate(**kw)
    out["uncached"] = (torch.equal(got.sequences, want.sequences),
                       max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
    return {**out, **_cached_generate(ours, ref, beams=False), "hub": _kimi_hub_checks(folder, ours)}


def _kimi_hub_checks(folder: str, ours) -> dict:
    """The hub-named copy (``_hub_named``) through ours and transformers: logits of 20 tokens against ``ours`` (the
    ``block_sparse_moe`` folder's model), bitwise, and transformers'; then both save_pretrained: the names and values
    each writes."""
    import transformers

    import loongforge_hf as lf

    hub, ids = f"{folder}-hub", _ids((2, 20), seed=5)
    mine = lf.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    with torch.no_grad():
        got = mine(input_ids=ids).logits
        out = {"bitwise": torch.equal(got, ours(input_ids=ids).logits),
               "transformers": float((got - theirs(input_ids=ids).logits).abs().max())}
    mine.save_pretrained(f"{hub}-ours")
    theirs.save_pretrained(f"{hub}-theirs")
    written, want = _tensors(f"{hub}-ours"), _tensors(f"{hub}-theirs")
    out["saved"] = (sorted(written) == sorted(want), all(torch.equal(written[n], want[n]) for n in want),
                    sorted(n for n in want if ".layers.0." in n and "_proj" in n and "attn" not in n))
    return out


def _tensors(folder: str) -> dict:
    return {n: t for f in sorted(Path(folder).glob("*.safetensors")) for n, t in load_file(f).items()}


def _hub_named(folder: str, *, both: bool = False) -> str:
    """A copy of the tiny Kimi folder with its dense layer's MLP named as the hub's checkpoints name it
    (``model.layers.0.mlp.*`` for ``block_sparse_moe``); ``both``: beside the ``block_sparse_moe`` ones, plus 1."""
    out = Path(f"{folder}-hub{'-both' if both else ''}")
    shutil.copytree(folder, out)
    index = json.loads((out / INDEX).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(out / shard)
        dense = {n: n.replace(".block_sparse_moe.", ".mlp.") for n in tensors
                 if n.startswith("model.layers.0.block_sparse_moe.")}
        if dense:
            kept = tensors if both else {n: t for n, t in tensors.items() if n not in dense}
            save_file({**kept, **{new: tensors[n] + int(both) for n, new in dense.items()}}, out / shard,
                      metadata={"format": "pt"})
            index["weight_map"] = {**{n: f for n, f in index["weight_map"].items() if both or n not in dense},
                                   **{new: shard for new in dense.values()}}
    (out / INDEX).write_text(json.dumps(index))
    return str(out)


def _all(folders: dict) -> dict:
    from ..integrations._lora_hybrids import ALL_LINEAR, hybrid_lora_checks

    checks = {"qwen3_5": _checks, "kimi_linear": _kimi_checks}
    out = {arch: checks.get(arch, _moe_checks)(folder) for arch, folder in folders.items()}
    out["lora"] = hybrid_lora_checks(folders["qwen3_5"], f"{folders['qwen3_5']}-lora-tp1", {}, ALL_LINEAR)
    out["next_lora"] = hybrid_lora_checks(folders["qwen3_next"], f"{folders['qwen3_next']}-lora-tp1", {},
                                          {**ALL_LINEAR, "target_modules": ["in_proj_qkvz", "in_proj_ba"]})
    return out


def _cached_generate(ours, ref, *, beams: bool) -> dict:
    """Greedy (and, with ``beams``, 2-beam) cached generate of a left-padded batch of two (the second prompt 4 tokens
    shorter): (sequences equal, largest score difference) against transformers' dynamic cache; the greedy call's
    cache layers; the lengths each of our forwards ran (the prefill, then one token a step)."""
    from tests._generation import step_lengths

    ids = _ids((2, 9), seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = {}
    for name, extra in {"greedy": {}, "beam": {"num_beams": 2}}.items() if beams else {"greedy": {}}.items():
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_scores=True, **extra)
        got, want = ours.generate(**kw), ref.generate(**kw)
        out[f"cached_{name}"] = (torch.equal(got.sequences, want.sequences),
                                 max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
        if name == "greedy":  # NOTE: the returned cache's layers, and a Gated DeltaNet's states (shape, dtype)
            layers = got.cache.layers
            out["cache_layers"] = ([type(layer).__name__ for layer in layers],
                                   [(tuple(t.shape), t.dtype) for t in (layers[-1].conv_states[0],
                                                                        layers[-1].recurrent_states[0])])
    out["cached_lengths"] = step_lengths(ours, lambda: ours.generate(input_ids=ids, attention_mask=mask,
                                                                     max_new_tokens=4))
    return out


def _two_rank_checks(folder: str) -> dict:
    """Cached greedy generate at TP2 with sequence parallelism (each rank its heads' states; a one-token step padded
    to two, the padding kept out of the states); then context parallelism over the same two ranks (``_cp2_checks``)."""
    import transformers

    import loongforge_hf as lf

    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                   sequence_parallel=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = _cached_generate(ours, ref, beams=False)
    del ours
    out["cp2"] = _cp2_checks(folder, ref)
    from ..integrations._lora_hybrids import ALL_LINEAR, hybrid_lora_checks

    out["lora"] = hybrid_lora_checks(folder, f"{folder}-lora-tp2", dict(tensor_parallel_size=2, sequence_parallel=True),
                                     ALL_LINEAR)
    return out


def _cp2_checks(folder: str, ref) -> dict:
    """CP2: an uncached greedy generate of a 6-token prompt (8 with the layout's padding: chunks of 2, shorter than
    the conv's 3-token history) and the refused cached one; then ``_cp2_padded_and_packed``."""
    import loongforge_hf as lf

    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    prompt = _ids((1, 6), seed=2).to(ref.device)
    kw = dict(input_ids=prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    got, want = ours.generate(use_cache=False, **kw), ref.generate(**kw)
    out = {"generate": (torch.equal(got.sequences, want.sequences),
                        max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))}
    try:
        ours.generate(input_ids=prompt, max_new_tokens=2)
        out["cached_refusal"] = None
    except ValueError as e:
        out["cached_refusal"] = str(e)
    return {**out, **_cp2_padded_and_packed(ours, ref, folder)}


def _cp2_padded_and_packed(ours, ref, folder: str) -> dict:
    """CP2 (four chunks of 38 tokens, each rank two): one batch of a row packing documents of 38, 35, 10, 12 and 57
    tokens (starts at a chunk's first token, 3 tokens before a chunk's end, and twice inside the next chunk: its
    first 7 tokens read the state coming in, one document lies within it, the last runs on to the end) and a row
    left-padded by 9, labels ignored on padding and across documents. Against transformers (each document alone,
    the padded row with its mask): the logits, the loss, and every parameter's gradient (reduced over CP as
    megatron's DDP, exported through the bridge; relative to each tensor's largest, rank 0). On ``ref``'s device."""
    import torch.distributed as dist

    from ._gradients import gradient_diffs, save_gradients

    ref.zero_grad(set_to_none=True)  # NOTE: the reference's gradients are this batch's alone
    ids = _ids((2, 152), seed=4).to(ref.device)
    positions = torch.stack([torch.cat([torch.arange(n) for n in CP_LENGTHS]), torch.arange(152)]).to(ref.device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, positions[0] == 0] = -100  # NOTE: no document predicts the next one's first token
    got = ours(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels)
    got.loss.backward()
    parts, start = [], 0  # NOTE: transformers' pieces: each document alone, the padded row with its mask
    for n in CP_LENGTHS:
        parts.append(dict(input_ids=ids[:1, start:start + n], labels=labels[:1, start:start + n]))
        start += n
    parts.append(dict(input_ids=ids[1:], attention_mask=mask[1:], labels=labels[1:]))
    counts = [int((p["labels"][:, 1:] != -100).sum()) for p in parts]
    results = [ref(**p) for p in parts]
    loss = sum(res.loss * n for res, n in zip(results, counts)) / sum(counts)
    loss.backward()
    want = torch.cat([res.logits[0] for res in results[:-1]])
    out = {"logits": max(float((got.logits[0] - want).abs().max()),
                         float((got.logits[1] - results[-1].logits[0]).abs()[mask[1].bool()].max())),
           "loss": abs(got.loss.item() - loss.item())}
    save_gradients(ours, f"{folder}-cp2-grads")
    if dist.get_rank() == 0:
        out["grads"] = gradient_diffs(f"{folder}-cp2-grads", ref)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    # NOTE: Qwen3.5's with the hub's multi-token-prediction tensors (mtp.*), which it passes through
    out = {arch: str(make_tiny_checkpoint(root / arch, arch, mtp_layers=int(arch == "qwen3_5")))
           for arch in ("qwen3_5",) + MOE_ARCHS + ("kimi_linear",)}
    _hub_named(out["kimi_linear"])  # NOTE: Kimi's as the hub names it, beside (``_kimi_hub_checks``)
    return out


@pytest.fixture(scope="module")
def everything(folders):
    return run_distributed(_all, 1, folders, timeout=400)[0]


@pytest.fixture(scope="module")
def results(everything):
    return everything["qwen3_5"]


@pytest.fixture(scope="module")
def folder(folders):
    return folders["qwen3_5"]


@pytest.mark.parametrize("arch", ("qwen3_5",) + MOE_ARCHS)
def test_long_sequences_and_left_padding(everything, arch):
    """150 tokens (three chunks of the delta rule: the state crosses chunks) with the second row left-padded by 9;
    the MoE models' loss and balancing loss too."""
    r = everything[arch]
    assert r["padded"] < TOL, r["padded"]
    if arch in MOE_ARCHS:
        assert r["moe"]["loss"] < TOL and r["moe"]["aux"] < AUX_TOL and r["moe"]["aux_value"] > 0.1, r["moe"]


@pytest.mark.parametrize("arch", ("qwen3_5",) + MOE_ARCHS)
def test_packed_documents_restart_the_recurrence(everything, arch):
    """A row packing documents of 7, 20 and 11 tokens (position ids restarting at 0) gives each document's logits as
    transformers gives them for the document alone (the conv and the state restart; transformers' torch fallback
    would run on across documents, its fla kernels restart as we do)."""
    assert max(everything[arch]["packed"]) < TOL, everything[arch]["packed"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("mode", ("uncached", "cached"))
def test_moe_generate_left_padded_batch(everything, arch, mode):
    same, scores = everything[arch][mode]
    assert same and scores < TOL, everything[arch][mode]


def test_kimi_linear_long_padded_packed_and_generate(everything):
    """Kimi Linear against transformers: 150 left-padded tokens (the KDA state crosses chunks; logits and loss),
    packed documents (the conv and the state restart, MLA attends within its document), greedy generate of a
    left-padded batch without and with the cache; the cache: one KV layer (MLA), then per KDA layer the last 3 of
    its 3 * 4 * 16 conv channels and the fp32 state ``[batch, heads, 16, 16]``; one token a forward after the
    prefill."""
    r = everything["kimi_linear"]
    assert r["padded"] < TOL and r["loss"] < TOL and max(r["packed"]) < TOL, r
    for name in ("uncached", "cached_greedy"):
        same, scores = r[name]
        assert same and scores < TOL, (name, r[name])
    kinds, states = r["cache_layers"]
    assert kinds == ["DynamicLayer"] + ["LinearAttentionLayer"] * 3, kinds
    assert states == [((2, 192, 3), torch.float32), ((2, 4, 16, 16), torch.float32)], states
    assert r["cached_lengths"] == [9, 1, 1, 1], r["cached_lengths"]


def test_kimi_linear_hub_names_load_and_save_as_transformers(everything):
    """The hub's naming of the dense layer's MLP (``model.layers.0.mlp.*``) loads through ``checkpoint_aliases``:
    logits equal to the ``block_sparse_moe`` folder's bitwise and to transformers' within 1e-4; save_pretrained writes
    the names and values transformers' save_pretrained writes after loading it (``block_sparse_moe``, none twice)."""
    r = everything["kimi_linear"]["hub"]
    assert r["bitwise"] and r["transformers"] < TOL, r
    same_names, same_values, dense = r["saved"]
    assert same_names and same_values, r["saved"]
    assert dense == [f"model.layers.0.block_sparse_moe.{p}_proj.weight" for p in ("down", "gate", "up")], dense


def test_kimi_linear_both_names_read_as_transformers(folders):
    """A folder with the dense MLP under both names (the ``mlp`` ones 1 larger): transformers 5.24 loads the
    ``block_sparse_moe`` tensors and lists nothing unexpected; our reader shows the same tensors (the ``mlp`` ones
    hidden: not loaded, not unexpected, not written back), so both read the same values. Without the bridge's aliases
    the hub-named folder fails the name check, naming the missing tensor (pure: no process group)."""
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.bridges.checkpoint_io import CheckpointError, CheckpointReader
    from loongforge_hf.bridges.fp8_checkpoint import dequantizing_reader
    from loongforge_hf.bridges.load_kwargs import loading_info

    folder = folders["kimi_linear"]
    both, name = _hub_named(folder, both=True), "model.layers.0.block_sparse_moe.gate_proj.weight"
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(both, dtype=torch.float32,
                                                                     output_loading_info=True)
    bridge = get_bridge(theirs.config)
    with CheckpointReader(both) as raw, CheckpointReader(folder) as plain:
        reader = dequantizing_reader(raw, bridge=bridge)
        assert sorted(reader.keys()) == sorted(plain.keys())
        assert torch.equal(reader.get(name), plain.get(name))
        assert torch.equal(theirs.model.layers[0].mlp.gate_proj.weight, plain.get(name))
        assert loading_info(raw, bridge)["unexpected_keys"] == info["unexpected_keys"] == set()
    with CheckpointReader(f"{folder}-hub") as raw:
        with pytest.raises(CheckpointError, match=rf"'{name}': missing"):
            dequantizing_reader(raw).validate_shapes(bridge.expected_hf_shapes())
        dequantizing_reader(raw, bridge=bridge).validate_shapes(bridge.expected_hf_shapes())


def test_mtp_tensors_written_back(results):
    """The hub's ``mtp.*`` tensors (not built, as transformers skips them) come back unchanged from save_pretrained."""
    source, written, equal = results["mtp"]
    assert len(source) == 7 and written == source and equal, results["mtp"]


def test_generate_without_cache(results):
    same, scores = results["generate"]
    assert same and scores < TOL, results["generate"]


def test_cached_generate_left_padded_batch(results):
    """Greedy and beam search with the cache: transformers' tokens and scores; after the prefill each forward runs
    the new token only."""
    for name in ("cached_greedy", "cached_beam"):
        same, scores = results[name]
        assert same and scores < TOL, (name, results[name])
    assert results["cached_lengths"] == [9, 1, 1, 1], results["cached_lengths"]
    _check_cache_layers(results["cache_layers"], heads=4)


def _check_cache_layers(layers, *, heads: int) -> None:
    """One KV layer for the full-attention layer, then one state layer per Gated DeltaNet (layers 0, 1, 3): the
    last ``conv_kernel - 1`` = 3 inputs of the q / k / v channels (2 * 2 * 8 + 4 * 12 over all heads), in the
    activations' dtype; the fp32 state ``[batch, value heads, key dim, value dim]`` of this rank's heads."""
    kinds, states = layers
    assert kinds == ["DynamicLayer"] + ["LinearAttentionLayer"] * 3, kinds
    assert states == [((2, 80 * heads // 4, 3), torch.float32), ((2, heads, 8, 12), torch.float32)], states


def test_static_cache_refused(results):
    assert results["static_refusal"] is not None and "cache_implementation='static' is not supported for " \
        "Qwen3_5ForCausalLM" in results["static_refusal"] and "dynamic cache" in results["static_refusal"], \
        results["static_refusal"]


@pytest.fixture(scope="module")
def two_ranks(folder):
    return run_distributed(_two_rank_checks, 2, folder, timeout=300)


def test_cached_generate_tp2_sequence_parallel(two_ranks):
    for rank, res in enumerate(two_ranks):
        same, scores = res["cached_greedy"]
        assert same and scores < TOL, (rank, res)
        assert res["cached_lengths"] == [10, 2, 2, 2], (rank, res["cached_lengths"])  # NOTE: padded to TP
        _check_cache_layers(res["cache_layers"], heads=2)


def test_context_parallel_padding_and_packed_documents(two_ranks):
    """CP2 over packed documents and left padding (``_cp2_padded_and_packed``): transformers' logits, loss and
    gradients of every tensor (the Gated DeltaNets' too) on both ranks' shares."""
    for rank, res in enumerate(two_ranks):
        cp = res["cp2"]
        assert cp["logits"] < TOL and cp["loss"] < TOL, (rank, cp)
    grads = two_ranks[0]["cp2"]["grads"]
    assert any(".linear_attn." in n for n in grads) and len(grads) == 56, sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


def test_context_parallel_generate(two_ranks):
    """An uncached greedy generate under CP2 (a short prompt: chunks shorter than the conv's history) gives
    transformers' tokens and scores; a cached one is refused on every rank, naming the way out."""
    for rank, res in enumerate(two_ranks):
        same, scores = res["cp2"]["generate"]
        assert same and scores < TOL, (rank, res["cp2"]["generate"])
        assert "cannot carry the states of recurrent (Gated DeltaNet / Mamba2) layers; under context parallelism " \
            "generate with use_cache=False" in res["cp2"]["cached_refusal"], \
            (rank, res["cp2"]["cached_refusal"])


@pytest.mark.parametrize("layout", ("tp1", "tp2"))
def test_lora_all_linear_matches_peft(everything, two_ranks, layout):
    """LoRA with ``"all-linear"`` at TP1 and TP2 + SP against PEFT (``integrations/_lora_hybrids.py``): each Gated
    DeltaNet in-projection (``in_proj_qkv`` / ``z`` / ``b`` / ``a``) in its slot of megatron's ``in_proj``, the gated
    ``q_proj`` beside ``k_proj`` / ``v_proj``, ``out_proj``, ``o_proj`` and the MLPs (31 modules): logits, loss, every
    adapter's A and B gradient at HF shape; the adapter folder in PEFT and the merged export in transformers. Every
    sectioned tensor, the in-projection's adapters' B included (in_proj_qkv's: this rank's q, k and v rows), is keyed
    per section in a training checkpoint: nothing keeps it from resuming under another TP size."""
    from ..integrations._lora_hybrids import check_matches_peft

    ranks = [everything["lora"]] if layout == "tp1" else [r["lora"] for r in two_ranks]
    check_matches_peft(ranks, targets=31)
    assert all(res["not_reshardable"] == [] for res in ranks), ranks


def test_kimi_linear_all_linear_plans_the_gate_projections(folders):
    """Kimi Linear's ``"all-linear"`` plans the KDA gates' low-rank projections, parameters of our mixer
    (``lora/own_weights.py``): ``f_a_proj`` / ``g_a_proj`` replicated, ``f_b_proj`` / ``g_b_proj`` split with the heads
    (refused before); compared with PEFT at TP1 and TP2 + SP in tests/integrations/test_lora_new_bridges.py."""
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora.plan import plan_lora

    from ..integrations._lora_hybrids import ALL_LINEAR

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folders["kimi_linear"]))
    plan = plan_lora(bridge, peft.LoraConfig(**ALL_LINEAR))
    gates = {(t.name, t.kind, t.own_weight) for t in plan.targets if t.own_weight}
    assert gates == {("f_a_proj", "replicated", "f_a_weight"), ("g_a_proj", "replicated", "g_a_weight"),
                     ("f_b_proj", "column", "f_b_weight"), ("g_b_proj", "column", "g_b_weight")}, gates
    assert {"b_proj", "kv_b_proj", "o_proj"} <= {t.name for t in plan.targets}


def test_qwen3_next_in_proj_lora_matches_peft(everything):
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (rows per key head, regrouped by section in megatron's
    ``in_proj``) against PEFT at TP1, as above."""
    from ..integrations._lora_hybrids import check_matches_peft

    check_matches_peft([everything["next_lora"]], targets=4)


def test_mask_layout_read_once_per_mask(monkeypatch):
    """The Gated DeltaNet layers read a mask's layout (a wait for the device) once per mask tensor: again for a new
    mask, or after the mask is written to; the layout itself (padding, packed document starts) as read."""
    from loongforge_hf.bridges import recurrent_common

    reads = []
    real_read = recurrent_common._read_layout
    monkeypatch.setattr(recurrent_common, "_read_layout", lambda *a: reads.append(1) or real_read(*a))
    causal = ~torch.ones(6, 6, dtype=torch.bool).tril()
    mask = causal.repeat(2, 1, 1, 1)
    mask[1, 0, :, :2] = True  # NOTE: row 1 left-padded by 2
    mask[1, 0, 2:, :2] = True
    for _ in range(3):
        real, starts = recurrent_common._token_layout(mask, 2, 6)
    assert len(reads) == 1 and starts is None and real.tolist() == [[True] * 6, [False] * 2 + [True] * 4]
    mask[0, 0, 3:, :3] = True  # NOTE: row 0 now packs documents of 3 and 3 tokens
    real, starts = recurrent_common._token_layout(mask, 2, 6)
    assert len(reads) == 2 and starts == [[3], []], starts
    recurrent_common._token_layout(mask.clone(), 2, 6)
    assert len(reads) == 3
