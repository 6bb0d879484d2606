"""Bamba (BambaForCausalLM) and Nemotron-H (NemotronHForCausalLM) on our Mamba2 mixer, fp32 against transformers within
1e-4 (Granite 4.0 H's checks, ``test_granitemoehybrid.py``): 70-token rows (five chunks of the tiny models' 16-token SSD
scan) with the second left-padded by 9, logits and loss; a row packing documents against each document alone; cached
greedy and beam search over a left-padded batch; a bit-exact export round trip. Nemotron-H's tiny model has a layer of
each kind (Mamba2, MoE, attention, MLP, Mamba2, MoE); its dense variant (Nemotron Nano 2's kinds: no MoE layer) too.
In a two-rank world: Bamba at TP2 with sequence parallelism (logits, loss, every gradient), with one group (the hub's
``mamba_n_groups=1``) at TP2 + SP, PP2 and CP2 (packed documents and left padding: logits, loss, every gradient);
Nemotron-H at TP2 + SP (logits, loss, every parameter's gradient exported through the bridge), PP2 (three layers a
stage), EP2 and TP2 + SP + EP2 (ETP1; every gradient too), and CP2 (packed documents and left padding across several
scan chunks per CP chunk: logits, loss, every gradient). Nemotron-H's relu2 experts run on loongforge's grouped MLP
(plain stacks, ``kernels/grouped_mlp.py``): at TP1 every gradient against transformers' too, and logits, loss and
every gradient against megatron's ``SequentialMLP`` (``LOONGFORGE_MOE_GROUPED_GEMM=0``: bit for bit here, asserted
within 1e-6 of each tensor's largest); at TP2 (ETP2) and TP2 + EP2 the stacks' checkpoint layout against
``SequentialMLP``'s built on the same process groups. LoRA on Nemotron-H's attention and Mamba2 ``in_proj`` against
PEFT at TP1 and TP2 + SP (``integrations/_lora_hybrids.py``). Falcon-H1 (FalconH1ForCausalLM: a Mamba2 mixer beside
the attention in every layer, muP multipliers; ``_falcon_one_rank`` / ``_falcon_two_ranks``) in the same worlds.
The Mamba family (``_mamba_one_rank`` / ``_mamba_two_ranks``): Mamba2ForCausalLM (our Mamba2 mixer, a pure stack),
MambaForCausalLM / FalconMambaForCausalLM (our Mamba-1 mixer, ``bridges/mamba1.py``) and JambaForCausalLM (Mamba-1,
attention and MoE layers) at TP1 (left padding, packed documents, cached generate, round trips; Jamba's router logits,
balance loss and LoRA against PEFT), TP2 + SP (every gradient of each), Mamba at PP2, Mamba2, Mamba (the Mamba-1
states passed between the chunks, ``parallel/linear_scan_cp.py``) and Jamba at CP2 (packed documents and left padding:
logits, loss, every gradient), Jamba at EP2. Refusals are checked on the bridge alone (pure, before any
collective)."""

import re

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .test_granitemoehybrid import TOL, _cached_generate, _check_padded, _gradients, _ids

EXPERTS_ENV = "LOONGFORGE_MOE_GROUPED_GEMM"

DENSE_KINDS = ["linear_attention", "mlp", "full_attention", "mlp"]
# NOTE: the attention layer's q / k / v / o and the Mamba2 layers' in_proj (z, x, B, C, dt row sections), PEFT's
# names (transformers' module tree: model.layers.N.mixer.*) on the checkpoint's backbone.layers.N.mixer.*
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "in_proj"],
            init_lora_weights=False)
MAMBA_STACKS = ("mamba2", "mamba", "falcon_mamba")
MAMBA_FAMILY = (*MAMBA_STACKS, "jamba")  # NOTE: Jamba last (_mamba_one_rank reads its models after the loop)
CACHED = ("mamba2", "jamba")  # NOTE: cached generate on the Mamba2 mixer, and on the Mamba-1 mixer beside attention
# NOTE: every linear of Jamba but the Mamba dt_proj (refused by name: transformers reads its weight itself, so PEFT's
# adapter never acts); x_proj a parameter of our mixer (lora/own_weights.py)
JAMBA_LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["dt_proj"], init_lora_weights=False)
# NOTE: the kinds of the hub's Falcon-H1-0.5B: no gated norm, one group, the default time-step limit; tied here
FALCON_H1_HUB = dict(mamba_rms_norm=False, mamba_n_groups=1, time_step_limit=(0.0, float("inf")),
                     tie_word_embeddings=True)


def _padded(ours, ref) -> dict:
    """Two rows of 70 tokens, the second left-padded by 9: the largest logit difference on real tokens, the loss's."""
    ids = _ids((2, 70))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    with torch.no_grad():
        got, want = ours(**kw), ref(**kw)
    return {"logits": float((got.logits - want.logits).abs()[mask.bool()].max()),
            "loss": float(abs(got.loss - want.loss))}


def _against_sequential(grouped, folder: str) -> dict:
    """The grouped experts (``GroupedMLP``, the default) against megatron's ``SequentialMLP`` (``EXPERTS_ENV=0``) on
    one batch: the largest logit and loss difference and, over every parameter, the largest gradient difference
    relative to the tensor's largest (each expert of a stack against its ``local_experts.{e}`` parameter)."""
    import os

    import loongforge_hf as lf

    previous = os.environ.get(EXPERTS_ENV)
    os.environ[EXPERTS_ENV] = "0"
    try:
        sequential = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    finally:
        os.environ.pop(EXPERTS_ENV) if previous is None else os.environ.update({EXPERTS_ENV: previous})
    ids = _ids((2, 24), seed=5)
    outs, grads = [], []
    for model in (grouped, sequential):
        for p in model.parameters():
            p.grad = None
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    ours, theirs = grads

    def reference(name, stack):
        if name in theirs:
            return theirs[name]
        return torch.stack([theirs[name.replace(".experts.linear_", f".experts.local_experts.{e}.linear_")]
                            for e in range(stack.shape[0])])

    worst = max(float((g - reference(n, g)).abs().max()) / (float(g.abs().max()) or 1.0) for n, g in ours.items())
    for p in grouped.parameters():  # NOTE: the next backward on it starts from no gradient
        p.grad = None
    return {"modules": [sorted({type(m).__name__ for m in model.modules()} & {"GroupedMLP", "SequentialMLP"})
                        for model in (grouped, sequential)],
            "logits": float((outs[0].logits - outs[1].logits).abs().max()),
            "loss": float(abs(outs[0].loss - outs[1].loss)), "grads": worst}


def _checkpoint_layout(model) -> list[str]:
    """The grouped experts' ``sharded_state_dict`` against megatron's ``SequentialMLP`` of plain MLPs built on the
    same config and process groups: each local expert's block of a stack at megatron's key, global shape, offset
    and replica id; the mismatches (none expected)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    ours = next(m for m in model.chunks[0].modules() if type(m).__name__ == "GroupedMLP")
    theirs = SequentialMLP(ours.num_local_experts, ours.config,
                           MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                           pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    layer = ((0, 1, 6),)  # NOTE: layer 1 of 6, the axis megatron's block prepends
    got, want = ours.sharded_state_dict("e.", layer), theirs.sharded_state_dict("e.", layer)
    bad = []
    for fc in ("linear_fc1", "linear_fc2"):
        stack = got[f"e.{fc}.weight"]
        for e in range(ours.num_local_experts):
            ref = want[f"e.local_experts.{e}.{fc}.weight"]
            offset = (stack.global_offset[0], stack.global_offset[1] + e, *stack.global_offset[2:])
            if (stack.key, stack.global_shape, offset, stack.local_shape[1:], stack.replica_id) != \
                    (ref.key, ref.global_shape, ref.global_offset, ref.local_shape, ref.replica_id):
                bad.append(f"{fc}[{e}]: {stack} != {ref}")
    return bad


def _models(folder: str, **layout):
    import transformers

    import loongforge_hf as lf

    return (lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout),
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


def _one_rank(folders: dict) -> dict:
    import tempfile

    from loongforge_hf.testing.round_trip import check_round_trip

    from ..integrations._lora_hybrids import hybrid_lora_checks
    from .test_qwen3_5 import packed_against_alone

    out = {}
    for name in ("bamba", "nemotron_h"):
        ours, ref = _models(folders[name])
        res = {"padded": _padded(ours, ref), "packed": packed_against_alone(ours, ref), **_cached_generate(ours, ref)}
        with tempfile.TemporaryDirectory() as saved:
            ours.save_pretrained(saved)
            check_round_trip(folders[name], saved)
            res["round_trip"] = True
        out[name] = res
    ids = _ids((2, 20), seed=4)
    with torch.no_grad():
        got, want = (model(input_ids=ids, output_router_logits=True).router_logits for model in (ours, ref))
    out["router_logits"] = (len(got), len(want), max(float((a - b).abs().max()) for a, b in zip(got, want)))
    out["against_sequential"] = _against_sequential(ours, folders["nemotron_h"])
    out["tp1_grads"] = _gradients(ours, ref, folders["nemotron_h"], "tp1")  # NOTE: overwrites ours with its grads
    del ours
    out["nemotron_h_dense"] = {"padded": _padded(*_models(folders["nemotron_h_dense"]))}
    out["lora"] = hybrid_lora_checks(folders["nemotron_h"], f"{folders['nemotron_h']}-lora-tp1", {}, LORA)
    return {**out, **_falcon_one_rank(folders), **_mamba_one_rank(folders)}


def _mamba_one_rank(folders: dict) -> dict:
    """The pure state-space stacks (Mamba2, Mamba, Falcon-Mamba) and Jamba: left-padded rows, packed documents, cached
    greedy and beam search, the export round trip; Jamba's router logits and balance loss, LoRA against PEFT."""
    import tempfile

    from loongforge_hf.testing.round_trip import check_round_trip

    from ..integrations._lora_hybrids import hybrid_lora_checks
    from .test_qwen3_5 import packed_against_alone

    out = {}
    for name in MAMBA_FAMILY:
        ours, ref = _models(folders[name])
        res = {"padded": _padded(ours, ref), "packed": packed_against_alone(ours, ref)}
        if name in CACHED:
            res.update(_cached_generate(ours, ref))
        with tempfile.TemporaryDirectory() as saved:
            ours.save_pretrained(saved)
            check_round_trip(folders[name], saved)
            res["round_trip"] = True
        out[name] = res
    ids = _ids((2, 20), seed=4)
    labels = ids.clone()
    with torch.no_grad():  # NOTE: Jamba's (the last) router logits (MoE layers 1, 3), its Mixtral balance loss
        got, want = (model(input_ids=ids, labels=labels, output_router_logits=True) for model in (ours, ref))
    out["jamba"]["router_logits"] = (len(got.router_logits), len(want.router_logits),
                                     max(float((a - b).abs().max()) for a, b in zip(got.router_logits,
                                                                                    want.router_logits)),
                                     float(abs(got.loss - want.loss)), float(abs(got.aux_loss - want.aux_loss)))
    out["jamba"]["lora"] = hybrid_lora_checks(folders["jamba"], f"{folders['jamba']}-lora-tp1", {}, JAMBA_LORA)
    return out


def _mamba_two_ranks(folders: dict) -> dict:
    """Mamba2, Mamba and Falcon-Mamba at TP2 + SP (logits, loss, every gradient); Mamba at
    PP2; Mamba2 and Mamba at CP2 (``test_qwen3_5._cp2_padded_and_packed``); Jamba at TP2 + SP (logits, loss, every
    gradient), EP2 and CP2."""
    import loongforge_hf as lf

    from .test_qwen3_5 import _cp2_padded_and_packed

    out, refs = {}, {}
    for name in MAMBA_STACKS:
        ours, refs[name] = _models(folders[name], tensor_parallel_size=2, sequence_parallel=True)
        out[f"{name}_tp2"] = _padded(ours, refs[name])
        out[f"{name}_grads"] = _gradients(ours, refs[name], folders[name], "tp2")
        del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folders["mamba"], dtype=torch.float32, pipeline_parallel_size=2)
    out["mamba_pp2"] = _padded(ours, refs["mamba"])
    del ours
    for name in ("mamba2", "mamba"):
        ours = lf.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32, context_parallel_size=2)
        out[f"{name}_cp2"] = _cp2_padded_and_packed(ours, refs[name], folders[name])
        del ours
    ours, ref = _models(folders["jamba"], tensor_parallel_size=2, sequence_parallel=True)
    out.update(jamba_tp2=_padded(ours, ref), jamba_grads=_gradients(ours, ref, folders["jamba"], "tp2"))
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folders["jamba"], dtype=torch.float32, expert_parallel_size=2)
    out["jamba_ep2"] = _padded(ours, ref)
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folders["jamba"], dtype=torch.float32, context_parallel_size=2)
    out["jamba_cp2"] = _cp2_padded_and_packed(ours, ref, folders["jamba"])
    return out


def _falcon_one_rank(folders: dict) -> dict:
    """Falcon-H1 (the gated norm before the gate, two groups): left-padded rows, packed documents, cached greedy and
    beam search, the export round trip; the hub's 0.5B kinds (no gated norm, one group, tied embeddings) and the
    norm after the gate: left-padded rows."""
    import tempfile

    from loongforge_hf.testing.round_trip import check_round_trip

    from .test_qwen3_5 import packed_against_alone

    ours, ref = _models(folders["falcon_h1"])
    res = {"padded": _padded(ours, ref), "packed": packed_against_alone(ours, ref), **_cached_generate(ours, ref)}
    with tempfile.TemporaryDirectory() as saved:
        ours.save_pretrained(saved)
        check_round_trip(folders["falcon_h1"], saved)
        res["round_trip"] = True
    return {"falcon_h1": res, "falcon_h1_hub": {"padded": _padded(*_models(folders["falcon_h1_hub"]))},
            "falcon_h1_after": {"padded": _padded(*_models(folders["falcon_h1_after"]))}}


def _bamba_two_ranks(folders: dict) -> dict:
    """Bamba at TP2 + SP (logits, loss, every gradient), with one group (the hub's ``mamba_n_groups=1``: B / C
    replicated over TP) at TP2 + SP, PP2 (two layers a stage) and CP2 (``test_qwen3_5._cp2_padded_and_packed``)."""
    import transformers

    import loongforge_hf as lf

    from .test_qwen3_5 import _cp2_padded_and_packed

    folder = folders["bamba"]
    ours, ref = _models(folder, tensor_parallel_size=2, sequence_parallel=True)
    out = {"bamba_tp2": _padded(ours, ref), "bamba_grads": _gradients(ours, ref, folder, "tp2")}
    del ours
    ours, ref = _models(folders["bamba_g1"], tensor_parallel_size=2, sequence_parallel=True)
    out["bamba_g1_tp2"] = _padded(ours, ref)
    del ours
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2)
    out["bamba_pp2"] = _padded(ours, ref)
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    out["bamba_cp2"] = _cp2_padded_and_packed(ours, ref, folder)
    return out


def _two_ranks(folders: dict) -> dict:
    import loongforge_hf as lf

    from ..integrations._lora_hybrids import hybrid_lora_checks
    from .test_qwen3_5 import _cp2_padded_and_packed

    out = _bamba_two_ranks(folders)
    folder = folders["nemotron_h"]
    ours, ref = _models(folder, tensor_parallel_size=2, sequence_parallel=True)
    out["tp2_layout"] = _checkpoint_layout(ours)
    out.update(tp2=_padded(ours, ref), grads=_gradients(ours, ref, folder, "tp2"))
    del ours
    for name, layout in (("pp2", dict(pipeline_parallel_size=2)), ("ep2", dict(expert_parallel_size=2)),
                         ("tp2_ep2", dict(tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2,
                                          expert_tensor_parallel_size=1))):
        ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        out[name] = _padded(ours, ref)
        if name == "tp2_ep2":
            out["tp2_ep2_layout"] = _checkpoint_layout(ours)
            out["tp2_ep2_grads"] = _gradients(ours, ref, folder, "tp2_ep2")
        del ours
    ref.zero_grad()
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    out["cp2"] = _cp2_padded_and_packed(ours, ref, folder)
    del ours
    out["lora"] = hybrid_lora_checks(folder, f"{folder}-lora-tp2", dict(tensor_parallel_size=2, sequence_parallel=True),
                                     LORA)
    return {**out, **_falcon_two_ranks(folders), **_mamba_two_ranks(folders)}


def _falcon_two_ranks(folders: dict) -> dict:
    """Falcon-H1 at TP2 + SP (logits, loss, every gradient), PP2 (two layers a stage) and CP2
    (``test_qwen3_5._cp2_padded_and_packed``); the hub's kinds (one group: B / C replicated) at TP2 + SP."""
    import loongforge_hf as lf

    from .test_qwen3_5 import _cp2_padded_and_packed

    folder = folders["falcon_h1"]
    ours, ref = _models(folder, tensor_parallel_size=2, sequence_parallel=True)
    out = {"falcon_h1_tp2": _padded(ours, ref), "falcon_h1_grads": _gradients(ours, ref, folder, "tp2")}
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2)
    out["falcon_h1_pp2"] = _padded(ours, ref)
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    out["falcon_h1_cp2"] = _cp2_padded_and_packed(ours, ref, folder)
    del ours
    out["falcon_h1_hub_tp2"] = _padded(*_models(folders["falcon_h1_hub"], tensor_parallel_size=2,
                                                sequence_parallel=True))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mamba_hybrids")
    return {"bamba": str(make_tiny_checkpoint(root / "bamba", "bamba")),
            "bamba_g1": str(make_tiny_checkpoint(root / "bamba_g1", "bamba", mamba_n_groups=1)),
            "nemotron_h": str(make_tiny_checkpoint(root / "nemotron_h", "nemotron_h")),
            "nemotron_h_dense": str(make_tiny_checkpoint(root / "dense", "nemotron_h", layers_block_type=DENSE_KINDS)),
            "falcon_h1": str(make_tiny_checkpoint(root / "falcon_h1", "falcon_h1")),
            "falcon_h1_hub": str(make_tiny_checkpoint(root / "falcon_h1_hub", "falcon_h1", **FALCON_H1_HUB)),
            "falcon_h1_after": str(make_tiny_checkpoint(root / "falcon_h1_after", "falcon_h1",
                                                        mamba_norm_before_gate=False)),
            **{name: str(make_tiny_checkpoint(root / name, name)) for name in MAMBA_FAMILY}}


@pytest.fixture(scope="module")
def one_rank(folders):
    return run_distributed(_one_rank, 1, folders, timeout=300)[0]


@pytest.fixture(scope="module")
def two_ranks(folders):
    return run_distributed(_two_ranks, 2, folders, timeout=300)


@pytest.mark.parametrize("model", ("bamba", "nemotron_h", "nemotron_h_dense"))
def test_left_padded_rows_across_chunks(one_rank, model):
    _check_padded(one_rank[model]["padded"])


@pytest.mark.parametrize("model", ("bamba", "nemotron_h"))
def test_packed_documents_restart_the_scan(one_rank, model):
    assert max(one_rank[model]["packed"]) < TOL, one_rank[model]["packed"]


@pytest.mark.parametrize("model", ("bamba", "nemotron_h"))
def test_cached_generate_left_padded_batch(one_rank, model):
    """Greedy and 2-beam search with the cache: transformers' tokens and scores; one KV layer for the attention layer,
    then a state layer per Mamba2 layer (Bamba: 0, 1, 3; Nemotron-H: 0, 4)."""
    res = one_rank[model]
    for name in ("cached_greedy", "cached_beam"):
        same, scores = res[name]
        assert same and scores < TOL, (model, name, res[name])
    mamba = 3 if model == "bamba" else 2
    assert res["cache_layers"][0] == ["DynamicLayer"] + ["LinearAttentionLayer"] * mamba, res["cache_layers"]


def test_router_logits(one_rank):
    """Nemotron-H's ``router_logits`` (``output_router_logits``): one ``[tokens, experts]`` tensor per MoE layer."""
    ours, theirs, diff = one_rank["router_logits"]
    assert ours == theirs == 2 and diff < TOL, one_rank["router_logits"]


@pytest.mark.parametrize("model", ("bamba", "nemotron_h"))
def test_export_round_trip(one_rank, model):
    assert one_rank[model]["round_trip"]


@pytest.mark.parametrize("layout", ("bamba_tp2", "bamba_g1_tp2", "bamba_pp2", "tp2", "pp2", "ep2", "tp2_ep2"))
def test_two_rank_layouts(two_ranks, layout):
    for res in two_ranks:
        _check_padded(res[layout])


def _check_every_gradient(grads: dict) -> None:
    kinds = (".mixer.conv1d.bias", ".mixer.q_proj.weight", ".mixer.experts.down_proj", ".mixer.experts.up_proj",
             ".mixer.gate.weight", ".mixer.shared_experts.up_proj.weight", "layers.3.mixer.up_proj.weight")
    assert all(any(k in n for n in grads) for k in kinds) and len(grads) == 41, sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


@pytest.mark.parametrize("grads", ("grads", "tp2_ep2_grads", "cp2"))
def test_every_gradient(two_ranks, grads):
    """Nemotron-H at TP2 + SP (the experts split over ETP2), TP2 + SP + EP2 (ETP1) and CP2: every parameter's
    gradient (Mamba2, attention, MLP, routed experts' stacks and shared experts, router) exported through the
    bridge, against transformers'."""
    _check_every_gradient(two_ranks[0]["cp2"]["grads"] if grads == "cp2" else two_ranks[0][grads])


def test_grouped_experts_against_sequential_and_transformers(one_rank):
    """At TP1 the relu2 experts run on the grouped MLP's plain stacks: every gradient against transformers', and
    logits, loss and every gradient against megatron's ``SequentialMLP`` (bit for bit here; 1e-6 of each tensor's
    largest allowed)."""
    res = one_rank["against_sequential"]
    assert res["modules"] == [["GroupedMLP"], ["SequentialMLP"]], res
    assert res["logits"] < 1e-6 and res["loss"] < 1e-6 and res["grads"] < 1e-6, res
    _check_every_gradient(one_rank["tp1_grads"])


@pytest.mark.parametrize("layout", ("tp2_layout", "tp2_ep2_layout"))
def test_grouped_experts_checkpoint_layout(two_ranks, layout):
    """At TP2 (ETP2: fc1's rows and fc2's columns split) and TP2 + EP2 (ETP1: the experts split), every rank's
    stacks save as megatron's ``SequentialMLP`` of plain MLPs does: key, global shape, offset, replica id."""
    for rank, res in enumerate(two_ranks):
        assert res[layout] == [], (rank, res[layout])


@pytest.mark.parametrize("model", ("bamba", "nemotron_h"))
def test_context_parallel_padded_and_packed(two_ranks, model):
    cp = "bamba_cp2" if model == "bamba" else "cp2"
    for rank, res in enumerate(two_ranks):
        assert res[cp]["logits"] < TOL and res[cp]["loss"] < TOL, (rank, res[cp])


@pytest.mark.parametrize("grads", ("bamba_grads", "bamba_cp2"))
def test_bamba_every_gradient(two_ranks, grads):
    """Bamba at TP2 + SP and at CP2: every parameter's gradient (Mamba2 with its conv bias, half-rotary attention,
    gated MLP) exported through the bridge, against transformers'."""
    grads = two_ranks[0][grads] if grads == "bamba_grads" else two_ranks[0]["bamba_cp2"]["grads"]
    kinds = (".mamba.in_proj.weight", ".mamba.conv1d.bias", ".mamba.A_log", ".self_attn.q_proj.weight",
             ".feed_forward.gate_proj.weight", "model.final_layernorm.weight")
    assert all(any(k in n for n in grads) for k in kinds) and len(grads) == 51, sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


def _check_lora(ranks: list[dict]) -> None:
    for res in ranks:
        assert res["logits"] < TOL and res["loss"] < 1e-5 and res["unchanged_after_merged_export"], res
        assert res["targets"] == ["model.layers.0.mixer.in_proj", *(f"model.layers.2.mixer.{p}_proj" for p in "koqv"),
                                  "model.layers.4.mixer.in_proj"], res["targets"]
        worst = max(res["grads"].items(), key=lambda kv: kv[1])
        assert len(res["grads"]) == 12 and worst[1] < 1e-5, (worst, res["grads"])
    assert ranks[0]["adapter_logits_diff"] < TOL and ranks[0]["merged_logits_diff"] < TOL, ranks[0]


@pytest.mark.parametrize("layout", ("tp1", "tp2"))
def test_nemotron_h_lora_matches_peft(one_rank, two_ranks, layout):
    """LoRA on q / k / v / o and the Mamba2 ``in_proj`` at TP1 and TP2 + SP against PEFT (``_lora_hybrids``): logits,
    loss, every adapter's A and B gradient at HF shape (B's rows of ``in_proj`` back in the checkpoint's order); the
    adapter folder (PEFT's ``model.layers.*`` names) loads in PEFT and the merged export (``backbone.*``) in
    transformers, both giving our logits."""
    _check_lora([one_rank["lora"]] if layout == "tp1" else [r["lora"] for r in two_ranks])


def test_lora_refused_on_replicated_rows(folders):
    """One group (``mamba_n_groups=1``) at TP2: the Mamba2 ``in_proj``'s B / C rows are replicas, and LoRA on it is
    refused before anything changes (pure); at TP1 it is planned."""
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.model import check_replicated_rows
    from loongforge_hf.lora.plan import plan_lora

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folders["bamba_g1"]))
    plan = plan_lora(bridge, peft.LoraConfig(r=2, target_modules=["in_proj", "o_proj"]))
    check_replicated_rows(plan, 1)
    with pytest.raises(LoraConfigError, match=r"LoRA on model.layers.0.mamba.in_proj \.\.\.: tensor_parallel_size=2 "
                       r"replicates some of its row sections .*exclude_modules=\['in_proj'\]"):
        check_replicated_rows(plan, 2)


@pytest.mark.parametrize("arch, changes, field", [
    ("bamba", {"z_loss_coefficient": 0.1}, "z_loss_coefficient=0.1 is not supported"),
    ("nemotron_h", {"moe_latent_size": 32}, "moe_latent_size=32 is not supported"),
    ("nemotron_h", {"use_bias": True}, r"use_bias=True is not supported for NemotronHForCausalLM \(biases"),
    ("nemotron_h", {"mamba_hidden_act": "gelu"}, "mamba_hidden_act='gelu' is not supported")])
def test_refused_configs(folders, arch, changes, field):
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge

    config = transformers.AutoConfig.from_pretrained(folders[arch])
    for name, value in changes.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedConfigError, match=field):
        get_bridge(config)


def test_refused_layout_and_mtp_passthrough(folders):
    """Heads that do not split over TP name Nemotron-H's field; its ``mtp.*`` tensors are kept for export, not built."""
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folders["nemotron_h"]))
    with pytest.raises(UnsupportedConfigError, match="mamba_num_heads=8 does not split"):
        bridge.check_layout(ParallelConfig(tensor_parallel_size=16))
    assert bridge.passthrough_names(["mtp.layers.0.norm.weight", "backbone.norm_f.weight"]) == \
        ["mtp.layers.0.norm.weight"]


@pytest.mark.parametrize("model", ("falcon_h1", "falcon_h1_hub", "falcon_h1_after"))
def test_falcon_h1_left_padded_rows(one_rank, model):
    _check_padded(one_rank[model]["padded"])


def test_falcon_h1_packed_cached_and_round_trip(one_rank):
    """Packed documents restart the scan; cached greedy and 2-beam search give transformers' tokens and scores, with a
    KV layer per attention, then a state layer per Mamba2 mixer (both in every layer); the export is bit-exact."""
    res = one_rank["falcon_h1"]
    assert max(res["packed"]) < TOL, res["packed"]
    for name in ("cached_greedy", "cached_beam"):
        same, scores = res[name]
        assert same and scores < TOL, (name, res[name])
    assert res["cache_layers"][0] == ["DynamicLayer"] * 4 + ["LinearAttentionLayer"] * 4, res["cache_layers"]
    assert res["round_trip"]


@pytest.mark.parametrize("layout", ("falcon_h1_tp2", "falcon_h1_pp2", "falcon_h1_hub_tp2", "falcon_h1_cp2"))
def test_falcon_h1_two_rank_layouts(two_ranks, layout):
    for res in two_ranks:
        _check_padded(res[layout])


@pytest.mark.parametrize("grads", ("falcon_h1_grads", "falcon_h1_cp2"))
def test_falcon_h1_every_gradient(two_ranks, grads):
    """Falcon-H1 at TP2 + SP and at CP2: every parameter's gradient (the Mamba2 mixer with its norm and conv bias, the
    attention beside it, the MLP, the norms, embedding and LM head) exported through the bridge, against
    transformers'."""
    grads = two_ranks[0][grads] if grads == "falcon_h1_grads" else two_ranks[0]["falcon_h1_cp2"]["grads"]
    kinds = (".mamba.in_proj.weight", ".mamba.norm.weight", ".mamba.conv1d.bias", ".self_attn.k_proj.weight",
             ".feed_forward.gate_proj.weight", "model.final_layernorm.weight", "lm_head.weight")
    assert all(any(k in n for n in grads) for k in kinds) and len(grads) == 71, sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


@pytest.mark.parametrize("changes, field", [
    ({"projectors_bias": True}, "projectors_bias=True is not supported"),
    ({"mamba_use_mlp": False}, "mamba_use_mlp=False is not supported"),
    ({"ssm_multipliers": [1.0, 1.0]}, r"ssm_multipliers=\[1.0, 1.0\] is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported")])
def test_falcon_h1_refused_configs(folders, changes, field):
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge

    config = transformers.AutoConfig.from_pretrained(folders["falcon_h1"])
    for name, value in changes.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedConfigError, match=field):
        get_bridge(config)


@pytest.mark.parametrize("model", MAMBA_FAMILY)
def test_mamba_family_one_rank(one_rank, model):
    """Mamba2ForCausalLM / MambaForCausalLM / FalconMambaForCausalLM / JambaForCausalLM: left-padded rows, packed
    documents against each alone, a bit-exact export round trip; cached greedy and 2-beam search (transformers' tokens
    and scores; a state layer per Mamba layer, after Jamba's KV layer) on Mamba2 and Jamba (the Mamba-1 mixer)."""
    res = one_rank[model]
    _check_padded(res["padded"])
    assert max(res["packed"]) < TOL and res["round_trip"], res["packed"]
    if model not in CACHED:
        return
    for name in ("cached_greedy", "cached_beam"):
        same, scores = res[name]
        assert same and scores < TOL, (model, name, res[name])
    kv = ["DynamicLayer"] if model == "jamba" else []
    assert res["cache_layers"][0] == kv + ["LinearAttentionLayer"] * 3, res["cache_layers"]


def test_jamba_lora_matches_peft(one_rank):
    """LoRA on Jamba's Mamba in_proj / out_proj (x and z row sections), x_proj (a parameter of our mixer, before the
    dt / B / C norms), attention and MLPs at TP1 against PEFT (``_lora_hybrids``): logits, loss, every adapter's A and
    B gradient; the adapter folder in PEFT and the merged export in transformers give our logits."""
    res = one_rank["jamba"]["lora"]
    assert res["logits"] < TOL and res["loss"] < 1e-5 and res["unchanged_after_merged_export"], res
    assert len(res["targets"]) == 19 and {"model.layers.0.mamba.in_proj", "model.layers.0.mamba.x_proj"} <= set(
        res["targets"]), res["targets"]
    worst = max(res["grads"].items(), key=lambda kv: kv[1])
    assert len(res["grads"]) == 38 and worst[1] < 1e-5, (worst, res["grads"])
    assert res["adapter_logits_diff"] < TOL and res["merged_logits_diff"] < TOL, res


def test_jamba_router_logits_and_balance_loss(one_rank):
    """Jamba's ``router_logits`` (``output_router_logits``: one ``[tokens, experts]`` tensor per MoE layer) and the
    loss with transformers' Mixtral load-balancing term, its ``aux_loss``."""
    ours, theirs, diff, loss, aux = one_rank["jamba"]["router_logits"]
    assert ours == theirs == 2 and diff < TOL and loss < TOL and aux < TOL, one_rank["jamba"]["router_logits"]


@pytest.mark.parametrize("layout", ("mamba2_tp2", "mamba_tp2", "falcon_mamba_tp2", "mamba_pp2", "jamba_tp2",
                                    "jamba_ep2"))
def test_mamba_family_two_rank_layouts(two_ranks, layout):
    for res in two_ranks:
        _check_padded(res[layout])


@pytest.mark.parametrize("model, count", (("mamba2", 30), ("mamba", 32), ("jamba", 63)))
def test_mamba_family_context_parallel_padded_and_packed(two_ranks, model, count):
    """Mamba2ForCausalLM, MambaForCausalLM and JambaForCausalLM at CP2 (the Mamba2 / Mamba-1 mixers' conv halos and
    states passed between the chunks; Jamba's attention and experts beside): packed documents and left padding,
    logits, loss and every gradient against transformers'."""
    res = [r[f"{model}_cp2"] for r in two_ranks]
    for rank, one in enumerate(res):
        assert one["logits"] < TOL and one["loss"] < TOL, (rank, one)
    grads = res[0]["grads"]
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert len(grads) == count and worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


@pytest.mark.parametrize("model, count", (("mamba2", 30), ("mamba", 32), ("falcon_mamba", 32), ("jamba", 63)))
def test_mamba_family_every_gradient(two_ranks, model, count):
    """Mamba2, Mamba, Falcon-Mamba and Jamba at TP2 + SP: every parameter's gradient (Mamba-1's x_proj split by its
    columns, summed over TP; dt_proj, A_log, D, the conv and its bias split by channel; Jamba's replicated dt / B / C
    norms, attention, MLPs, router and experts) exported through the bridge, against transformers'."""
    grads = two_ranks[0][f"{model}_grads"]
    kinds = ("conv1d.bias", "in_proj.weight", "out_proj.weight", "A_log")
    kinds += {"mamba": ("x_proj.weight", "dt_proj.bias"), "falcon_mamba": ("x_proj.weight", "dt_proj.bias"),
              "mamba2": ("norm.weight", "dt_bias"),
              "jamba": ("dt_layernorm.weight", "c_layernorm.weight", "self_attn.k_proj.weight", "router.weight",
                        "experts.gate_up_proj", "experts.down_proj", "feed_forward.gate_proj.weight")}[model]
    assert len(grads) == count and all(any(k in n for n in grads) for k in kinds), sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


@pytest.mark.parametrize("arch, changes, layout, field", [
    ("mamba2", {"use_bias": True}, None, "use_bias=True is not supported for Mamba2ForCausalLM"),
    ("mamba", {"use_bias": True}, None, "use_bias=True is not supported for MambaForCausalLM"),
    ("falcon_mamba", {"hidden_act": "gelu"}, None, "hidden_act='gelu' is not supported for FalconMambaForCausalLM"),
    ("mamba2", {}, dict(tensor_parallel_size=16), "num_heads=8 does not split over tensor_parallel_size=16"),
    ("mamba", {}, dict(tensor_parallel_size=3), "intermediate_size (d_inner=128) does not split over"),
    ("jamba", {}, dict(tensor_parallel_size=3), "mamba_expand (d_inner=128) does not split over"),
    ("jamba", {"num_experts": 1}, None, "num_experts=1 is not supported for JambaForCausalLM"),
    ("jamba", {"mamba_proj_bias": True}, None, "mamba_proj_bias=True is not supported for JambaForCausalLM")])
def test_mamba_family_refused(folders, arch, changes, layout, field):
    """What the Mamba stacks cannot run is refused by the bridge alone (pure, before any collective), naming the
    field."""
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig

    config = transformers.AutoConfig.from_pretrained(folders[arch])
    for name, value in changes.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        get_bridge(config).check_layout(ParallelConfig(**(layout or {})))


@pytest.mark.parametrize("arch, name", (("mamba2", "Mamba2ForCausalLM"), ("mamba", "MambaForCausalLM"),
                                        ("jamba", "JambaForCausalLM")))
def test_mamba_family_static_cache_refused(folders, arch, name):
    """The static cache's fixed-shape decode step keeps no conv / SSM state: refused by name (pure), the dynamic cache
    taken."""
    import transformers

    from loongforge_hf.bridges import get_bridge

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folders[arch]))
    refusal = bridge.generation_refusal(transformers.GenerationConfig(use_cache=True, cache_implementation="static"))
    assert refusal is not None and f"cache_implementation='static' is not supported for {name}" in refusal, refusal
    assert bridge.generation_refusal(transformers.GenerationConfig(use_cache=True)) is None
