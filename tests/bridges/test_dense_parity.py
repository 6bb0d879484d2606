"""Dense bridges against transformers: logits/loss within 1e-4 (fp32) for each layout, bit-exact HF round trips."""


import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.tiny_models import PHI3_LONGROPE
from loongforge_hf.testing.round_trip import check_round_trip

from ._parity import load_compare_export, load_compare_export_many

TOL = 1e-4

LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, {"tensor_parallel_size": 2}),
    "pp2": (2, {"pipeline_parallel_size": 2}),
    "tp2pp2": (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
    "pp2vpp2": (2, {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}),
    "cp2": (2, {"context_parallel_size": 2}),
    "tp2cp2": (4, {"tensor_parallel_size": 2, "context_parallel_size": 2}),
}


# NOTE: context parallelism inside a pipeline (one architecture: the per-architecture code is covered above)
PIPELINE_CP_LAYOUTS = {
    "pp2cp2": (4, {"pipeline_parallel_size": 2, "context_parallel_size": 2}),
    "pp2vpp2cp2": (4, {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2, "context_parallel_size": 2}),
}


def run_case(tmp_path, arch, layout_name, *, padded=False, **model_kw):
    nprocs, layout = {**LAYOUTS, **PIPELINE_CP_LAYOUTS}[layout_name]
    src = make_tiny_checkpoint(tmp_path / "src", arch, **model_kw)
    out = tmp_path / "out"
    results = run_distributed(load_compare_export, nprocs, str(src), layout, str(out), padded=padded, timeout=300)
    check_results(results, arch)
    check_round_trip(src, out)
    return out


ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral", "phi3", "smollm3", "gemma3", "granite", "olmo2", "olmo3",
         "gemma", "gemma2", "ministral", "seed_oss", "arcee",
         "helium", "ernie4_5", "glm4", "exaone4", "starcoder2", "gpt_neox", "cohere", "cohere2", "phi", "gptj",
         "stablelm", "falcon", "falcon_mqa", "gpt2", "gpt_bigcode", "gpt_bigcode_mha", "qwen3_5"]


# NOTE: GLM-4-9B, OLMo (clip_qkv binding), Nemotron and Jais-2 (LayerNorms, biases on every linear but the LM head,
# an ungated relu2 MLP) at these layouts only (CI time): their per-architecture code is norms, MLP and rotary layout,
# which the other layouts exercise no differently
LEAN_ARCHS, LEAN_LAYOUTS = ["glm", "olmo", "nemotron", "jais2"], ("tp1", "tp2", "pp2")
# NOTE: HunYuan dense (q / k norms after the rotation, by position ids: HunYuan-MoE's attention, whose layouts the MoE
# suite runs), Apertus (xIELU's learned scalars, their gradients summed over TP: test_gradients) and EXAONE 3 (Llama
# under other names) at TP1 and TP2 only
TP_ARCHS, TP_LAYOUTS = ["hunyuan_v1_dense", "apertus", "exaone"], ("tp1", "tp2")
# NOTE: Apertus at PP2 too: its xIELU's 0-d beta / eps on the second stage are assembled by that stage's first rank
# and sent to rank 0 (the writer's and exporter's 0-d blocks)
SCALAR_ARCHS, SCALAR_LAYOUTS = ["apertus"], ("pp2",)
# NOTE: Ministral 3 (YaRN with an mscale ratio, Llama 4's query scale refused past it), VaultGemma (Gemma 2 without
# post norms), CWM (Llama with windowed layers) and NanoChat (norms without weights, one on the embedding, flipped
# rotary signs, q / k norms after the rotation, relu2, a logit soft-cap) at TP1 and TP2 + SP only: Mistral's, Gemma
# 2's, Ministral's and Arcee's / OLMo's layouts run the other layouts
# NOTE: Apertus 1.5's language model (Apertus with a full-width head) and Youtu (dense MLA, tied) there too
# NOTE: the classic decoders: Persimmon (GPT-NeoX's fused q / k / v run sequentially, q / k LayerNorms, relu2),
# CodeGen (GPT-J with q / v / k fused by shards), GPT-Neo (unscaled scores, local layers' windows, learned positions),
# OPT (positions two rows down their table, ReLU), GPT-NeoX-Japanese (a bias on the last layer's attention output only),
# BioGPT (OPT's with a scaled token embedding, GELU) and XGLM (sinusoidal positions computed, never loaded)
CLASSIC = ["persimmon", "codegen", "gpt_neo", "opt", "gpt_neox_japanese", "biogpt", "xglm"]
# NOTE: image-text families' language models as causal LMs: Emu3 (Llama's layout, its dropouts), Gemma 4 Unified
# (Gemma 4's text model without per-layer inputs or MoE block) and Cohere Compass (Cohere2's layer, rotate-half rope
# on the sliding layers only)
VLM_TEXT = ["emu3", "gemma4_unified", "cohere_compass"]
# NOTE: Granite SWA (sinks, windows, a NoPE layer, Granite's multipliers), HyperCLOVAX (Granite with post norms),
# BitNet (sub-norms over TP-split widths, relu2) and DiffLlama (differential attention, each TP rank a slice of both
# halves of the heads) there too
SP_ARCHS, SP_LAYOUTS = (["ministral3", "vaultgemma", "cwm", "nanochat", "apertus1p5", "youtu", "granite_swa",
                         "hyperclovax", "bitnet", "diffllama", *CLASSIC, *VLM_TEXT],
                        {"tp1": {}, "tp2": {"sequence_parallel": True}})
# NOTE: Granite SWA's NoPE layer, BitNet's sub-norms and DiffLlama's lambda_init by layer on the second stage too;
# the four at CP2 too
PP_ARCHS, PP_LAYOUTS = ["granite_swa", "bitnet", "diffllama"], ("pp2",)
CP_ARCHS, CP_LAYOUTS = ["granite_swa", "hyperclovax", "bitnet", "diffllama"], ("cp2",)


def check_results(results, arch):
    for r in results:
        assert r["logits_shape"] == (2, 12, 203), arch
        assert r["keep"][0] == (2, 3, 203) and r["keep"][1] < 1e-6, (arch, r["keep"])  # logits_to_keep=3
        assert r["logit_diff"] < TOL, (arch, r)
        assert r["loss_diff"] < TOL, (arch, r)
        if r["grads_ok"] is not None:
            assert r["grads_ok"], arch


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_parity_and_round_trip(tmp_path, layout_name):
    """Every dense architecture under ``layout_name`` (one world per layout keeps process starts few)."""
    nprocs, layout = LAYOUTS[layout_name]
    # NOTE: Falcon-7B's and StarCoder's one KV head runs under TP too, replicated on each rank (kv_replicas.py)
    archs = ARCHS + (LEAN_ARCHS if layout_name in LEAN_LAYOUTS else [])
    archs += TP_ARCHS if layout_name in TP_LAYOUTS else []
    archs += SCALAR_ARCHS if layout_name in SCALAR_LAYOUTS else []
    archs += SP_ARCHS if layout_name in SP_LAYOUTS else []
    archs += PP_ARCHS if layout_name in PP_LAYOUTS else []
    archs += CP_ARCHS if layout_name in CP_LAYOUTS else []
    cases = []
    for arch in archs:
        src = make_tiny_checkpoint(tmp_path / arch / "src", arch)
        more = (SP_LAYOUTS[layout_name],) if arch in SP_ARCHS and layout_name in SP_LAYOUTS else ()
        cases.append((str(src), str(tmp_path / arch / "out"), *more))
    per_rank = run_distributed(load_compare_export_many, nprocs, cases, layout, timeout=600)
    for i, arch in enumerate(archs):
        check_results([rank_results[i] for rank_results in per_rank], arch)
        check_round_trip(tmp_path / arch / "src", tmp_path / arch / "out")


@pytest.mark.parametrize("layout_name", ["tp2", "pp2"])
def test_starcoder2_without_biases(tmp_path, layout_name):
    """StarCoder2 with ``use_bias=False``: no linear biases (its LayerNorms keep theirs)."""
    out = run_case(tmp_path, "starcoder2", layout_name, use_bias=False)
    assert not any("proj.bias" in name or "c_fc.bias" in name for name in _weight_names(out))


# NOTE: Falcon2-11B's layout (the new decoder architecture with one norm before both sublayers, no biases, its rope
# base, linear rope scaling) and the older layout run sequentially with q / k / v per head and biases
FALCON_VARIANTS = {
    "falcon2": ("falcon", {"num_ln_in_parallel_attn": 1, "bias": False,
                           "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500042.0}}),
    "falcon_sequential": ("falcon_mqa", {"parallel_attn": False, "multi_query": False, "bias": True}),
}


def test_falcon_variants(tmp_path):
    """The Falcon layouts beyond the tiny checkpoints' (one TP2 world for both)."""
    cases = [(str(make_tiny_checkpoint(tmp_path / name / "src", arch, **kw)), str(tmp_path / name / "out"))
             for name, (arch, kw) in FALCON_VARIANTS.items()]
    per_rank = run_distributed(load_compare_export_many, 2, cases, LAYOUTS["tp2"][1], timeout=300)
    for i, name in enumerate(FALCON_VARIANTS):
        check_results([rank_results[i] for rank_results in per_rank], name)
        check_round_trip(tmp_path / name / "src", tmp_path / name / "out")
    falcon2, sequential = (_weight_names(tmp_path / name / "out") for name in FALCON_VARIANTS)
    layer = "transformer.h.0"
    assert {f"{layer}.post_attention_layernorm.bias", f"{layer}.mlp.dense_4h_to_h.bias"} <= set(sequential)
    assert f"{layer}.input_layernorm.weight" in falcon2 and not any(".ln_" in n and "ln_f" not in n for n in falcon2)
    assert all("layernorm" in n or "ln_f" in n for n in falcon2 if n.endswith(".bias"))  # NOTE: no linear's bias


def _weight_names(folder) -> list[str]:
    import json

    return list(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


@pytest.mark.parametrize("layout_name", ["tp1", "tp2pp2"])
def test_tied_embeddings(tmp_path, layout_name):
    run_case(tmp_path, "qwen3", layout_name, tie_word_embeddings=True)


def test_uneven_pipeline(tmp_path):
    run_case(tmp_path, "llama", "pp2", num_hidden_layers=5)


@pytest.mark.parametrize("layout_name", list(PIPELINE_CP_LAYOUTS))
def test_context_parallelism_in_a_pipeline(tmp_path, layout_name):
    run_case(tmp_path, "qwen3", layout_name, padded=True)


@pytest.mark.parametrize("layout_name", ["tp2", "cp2"])
def test_right_padding_mask(tmp_path, layout_name):
    run_case(tmp_path, "qwen2", layout_name, padded=True)


def test_export_loads_in_transformers(tmp_path):
    import transformers

    out = run_case(tmp_path, "qwen3", "tp2")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 203, (1, 9))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, back(ids).logits)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("tok5 tok6")["input_ids"] == [5, 6]


@pytest.mark.parametrize("layout_name", ["tp1", "tp2", "pp2", "cp2"])
def test_phi3_longrope(tmp_path, layout_name):
    """LongRoPE's short factors and attention factor (the logits are 0.003 off without the factor)."""
    run_case(tmp_path, "phi3", layout_name, **PHI3_LONGROPE)


def _past_original_max(folder: str) -> dict:
    """Phi-3 with LongRoPE at TP2, past original_max_position_embeddings (32): each result's largest difference from
    transformers (fp32, the same tokens on both ranks)."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(4, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.no_grad():
        for length in (40, 33, 32, 24):  # NOTE: the long factors from 33 positions on
            out[f"forward_{length}"] = float((model(input_ids=ids[:, :length]).logits
                                              - ref(input_ids=ids[:, :length]).logits).abs().max())
        # NOTE: a row packing two 20-token documents: positions up to 19, the short factors (transformers: each
        # document on its own)
        packed = model(input_ids=ids[:1], position_ids=torch.cat([torch.arange(20), torch.arange(20)])[None]).logits
        out["packed"] = float(max((packed[0, :20] - ref(input_ids=ids[:1, :20]).logits[0]).abs().max(),
                                  (packed[0, 20:] - ref(input_ids=ids[:1, 20:]).logits[0]).abs().max()))
        # NOTE: 28 prompt tokens + 8 new: transformers switches to the long factors at the step past position 31 and
        # keeps the keys it cached before; the dynamic and the static cache must do the same
        kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True)
        expected = ref.generate(input_ids=ids[:, :28], **kw)
        for cache in ("dynamic", "static"):
            got = model.generate(input_ids=ids[:, :28], cache_implementation=cache, **kw)
            out[f"generate_{cache}"] = (torch.equal(got.sequences, expected.sequences),
                                        float(max((a - b).abs().max() for a, b in zip(got.scores, expected.scores))))
    # NOTE: a training step's loss on a 40-token batch (the engine picks per micro-batch) and on a 24-token one
    engine = MegatronEngine(model, args=transformers.TrainingArguments("/tmp/unused", learning_rate=0.0,
                                                                       use_cpu=True, report_to=[]))
    for length in (40, 24):
        batch = {"input_ids": ids[:, :length], "labels": ids[:, :length]}
        loss = engine.train_step([batch]).loss
        with torch.no_grad():
            out[f"train_{length}"] = abs(loss - float(ref(**batch).loss))
    return out


def test_phi3_longrope_past_original_max(tmp_path):
    """Past original_max_position_embeddings transformers rotates every position with LongRoPE's long factors: logits
    of 40 and 33 positions (long), 32 and 24 (short) and a packed row of two 20-token documents (short) within 1e-4
    of transformers'; greedy generate of 28 + 8 tokens crossing the switch (dynamic and static cache) with
    transformers' tokens and scores (1e-4); training losses on 40- and 24-token batches (1e-4)."""
    src = make_tiny_checkpoint(tmp_path / "src", "phi3", **PHI3_LONGROPE)
    for r in run_distributed(_past_original_max, 2, str(src), timeout=300):
        for key, value in r.items():
            if key.startswith("generate"):
                assert value[0] and value[1] < TOL, (key, value)
            else:
                assert value < TOL, (key, value)


# YaRN (Qwen2.5 / Qwen3's long-context recipe) shrunk: factor 4 over 32 positions, attention factor 0.1 ln 4 + 1
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("arch,layout_name", [("llama", "tp2"), ("llama", "pp2"), ("qwen3", "tp1"), ("qwen3", "tp2"),
                                              ("qwen3", "cp2")])
def test_yarn(tmp_path, arch, layout_name):
    """YaRN's frequencies and attention factor (Qwen3: after its q / k norms); the logits are 0.003 (Llama) and 0.08
    (Qwen3) off without the factor."""
    run_case(tmp_path, arch, layout_name, rope_parameters=dict(YARN))
