"""Resuming a training checkpoint under another tensor-parallel size (``trainer/checkpoint_layout.py``,
``parallel/tp_sections.py``). Tensors whose TP ranks hold rows of several sections are keyed per section, so
DiffLlama's ``linear_qkv`` (each rank a slice of both halves of the heads) resumed at TP1 from TP2, and Mamba2's
in-projection and conv with one group (its B / C rows replicated over the two TP ranks) resumed at TP2 from TP1,
step on as the uninterrupted run does: without the sections both came back reordered, silently. So do Falcon's
single KV head replicated on both TP2 ranks resumed at TP1, and GPT-BigCode's (with biases) resumed at TP2 from
TP1: ``linear_qkv`` keyed head by head (before, a shape error that blamed the checkpoint); and LoRA runs (q / k /
v / o adapters, k / v's B rows on the replicated head; Falcon's packed ``query_key_value`` adapter, its B's K / V
rows on it; DiffLlama's q / k / v / o adapters, each rank's B rows its slice of both halves of the heads; Mamba's
``x_proj`` adapter, a parameter of our mixer, A split by its columns; Llama's adapter on the token embedding, A split
by the vocabulary) resumed at TP1 from TP2, and Doge's (its ``dt_proj`` adapter, B split by the KV heads' rows) at
TP2 from TP1. Refused by name, on every
rank, before megatron's load: checkpoints written before the sections (whole tensors) or before the replicated heads
were keyed per head under another size; they resume in their own layout (Zamba2, whose shared blocks megatron once
keyed as replicated, bit for bit). One 2-rank world."""

import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.tiny_doge import randomize

from ._train_parity import make_dataset, training_args

TP2 = {"tensor_parallel_size": 2, "sequence_parallel": True}


def _train(folder: str, out_dir: str, layout: dict, resume: str | None = None) -> str | None:
    """Two steps in ``layout`` (saving each; the global batch 2 whatever the data-parallel size), from ``resume``;
    the error's message where it fails with a CheckpointError."""
    import loongforge_hf as lf
    from loongforge_hf.bridges.checkpoint_files import CheckpointError

    dp = 2 // layout.get("tensor_parallel_size", 1)
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    if folder.endswith("_lora"):  # NOTE: k / v adapters' B rows (the packed adapter's K / V rows): the replicated head
        # (DiffLlama's: each rank's rows of both halves of the heads)
        import peft

        from loongforge_hf.lora import get_peft_model

        targets = ["query_key_value", "dense"] if "packed" in folder else \
            LORA_TARGETS.get(folder.rsplit("/", 1)[-1], ["q_proj", "k_proj", "v_proj", "o_proj"])
        model = get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                      target_modules=targets))
    args = training_args(out_dir, max_steps=2, save_strategy="steps", save_steps=1, gradient_accumulation_steps=1,
                         per_device_train_batch_size=2 // dp, warmup_steps=0)
    try:
        lf.LoongTrainer(model=model, args=args, train_dataset=make_dataset(n=8)).train(resume_from_checkpoint=resume)
    except CheckpointError as err:
        return str(err)
    return None


# NOTE: adapters on our modules' own weights (lora/own_weights.py): Mamba-1's x_proj (A split by its columns), Doge's
# dt_proj (B split by its rows); on the token embedding (lora/embedding.py: A split by the vocabulary) and the untied
# LM head (lora/head.py: B split by the vocabulary); beside linears
LORA_TARGETS = {"mamba_lora": ["in_proj", "x_proj"], "doge_lora": ["q_proj", "dt_proj", "o_proj"],
                "llama_embed_lora": ["embed_tokens", "q_proj"], "llama_head_lora": ["lm_head", "q_proj"]}
# NOTE: (written in, resumed in); Falcon's and GPT-BigCode's one KV head is replicated on both TP2 ranks
RESHARDED = {"diffllama": (TP2, {}), "mamba2": ({}, TP2), "falcon_mqa": (TP2, {}), "gpt_bigcode": ({}, TP2),
             "llama_mqa_lora": (TP2, {}), "falcon_mqa_packed_lora": (TP2, {}), "diffllama_lora": (TP2, {}),
             "mamba_lora": (TP2, {}), "doge_lora": ({}, TP2), "llama_embed_lora": (TP2, {}),
             "llama_head_lora": ({}, TP2)}


def _world(folders: dict, root: str) -> dict:
    import loongforge_hf.trainer.checkpoint as checkpoint

    out = {}
    for arch, (first, second) in RESHARDED.items():
        _train(folders[arch], f"{root}/{arch}/full", first)
        out[arch] = _train(folders[arch], f"{root}/{arch}/resumed", second, f"{root}/{arch}/full/checkpoint-1")
    # NOTE: checkpoints as loongforge-hf wrote them before the sections (whole tensors, no tp_sections in
    # layout.json) and before the replicated KV heads were keyed per head (no kv_blocks)
    write_layout, declared = checkpoint.write_layout, checkpoint.declared_sections
    checkpoint.write_layout = lambda path: path.write_text('{"tensor_parallel_size": 2}')
    checkpoint.declared_sections = lambda chunks, **kw: {}
    _train(folders["zamba2"], f"{root}/zamba2/full", TP2)
    checkpoint.write_layout = lambda path: path.write_text('{"tensor_parallel_size": 2, "tp_sections": true}')
    checkpoint.declared_sections = lambda chunks, **kw: declared(chunks, blocks=False)
    _train(folders["falcon_mqa"], f"{root}/falcon_mqa/old", TP2)
    checkpoint.write_layout, checkpoint.declared_sections = write_layout, declared
    out["zamba2"] = _train(folders["zamba2"], f"{root}/zamba2/resumed", TP2, f"{root}/zamba2/full/checkpoint-1")
    out["zamba2_tp1"] = _train(folders["zamba2"], f"{root}/zamba2/tp1", {}, f"{root}/zamba2/full/checkpoint-1")
    out["falcon_mqa_old"] = _train(folders["falcon_mqa"], f"{root}/falcon_mqa/old_tp1", {},
                                   f"{root}/falcon_mqa/old/checkpoint-1")
    out["falcon_mqa_old_tp2"] = _train(folders["falcon_mqa"], f"{root}/falcon_mqa/old_tp2", TP2,
                                       f"{root}/falcon_mqa/old/checkpoint-1")
    return out


def _weights(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_resume_under_another_tensor_parallel_size(tmp_path):
    folders = {arch: str(make_tiny_checkpoint(tmp_path / arch, arch, **kw)) for arch, kw in
               (("diffllama", {}), ("mamba2", {"n_groups": 1}), ("falcon_mqa", {}), ("gpt_bigcode", {}),
                ("zamba2", {}))}
    folders["llama_mqa_lora"] = str(make_tiny_checkpoint(tmp_path / "llama_mqa_lora", "llama", num_key_value_heads=1))
    folders["falcon_mqa_packed_lora"] = str(make_tiny_checkpoint(tmp_path / "falcon_mqa_packed_lora", "falcon_mqa"))
    folders["diffllama_lora"] = str(make_tiny_checkpoint(tmp_path / "diffllama_lora", "diffllama"))
    for arch in ("mamba", "doge"):
        folders[f"{arch}_lora"] = str(make_tiny_checkpoint(tmp_path / f"{arch}_lora", arch))
    folders["llama_embed_lora"] = str(make_tiny_checkpoint(tmp_path / "llama_embed_lora", "llama"))
    # NOTE: a vocabulary megatron pads to 384 rows at TP1 and 512 at TP2 (B's rows, as the head's weight)
    folders["llama_head_lora"] = str(make_tiny_checkpoint(tmp_path / "llama_head_lora", "llama", vocab_size=300))
    randomize(folders["doge_lora"])  # NOTE: A drawn: with transformers' zeros dt_proj (and its adapter) has no effect
    runs = tmp_path / "runs"
    for rank in run_distributed(_world, 2, folders, str(runs), timeout=400):
        assert [rank[arch] for arch in (*RESHARDED, "zamba2", "falcon_mqa_old_tp2")] == [None] * 13, rank
        assert "KV heads are replicated over tensor-parallel ranks (num_key_value_heads=1" in \
            (rank["falcon_mqa_old"] or ""), rank
        assert "written before loongforge-hf keyed them per head" in rank["falcon_mqa_old"], rank
        assert "cannot be resumed in this layout" in rank["falcon_mqa_old"], rank
        assert "tensor_parallel_size=2, this run has 1: resharding is not supported for ['Adapter', 'Mamba2Mixer', " \
            "'SharedBlock']" in (rank["zamba2_tp1"] or ""), rank
        assert "written before loongforge-hf keyed them per section" in rank["zamba2_tp1"], rank
    for arch in RESHARDED:  # NOTE: step 2 after the resume in the other layout: the same weights
        full, resumed, before = (_weights(runs / arch / d) for d in ("full/checkpoint-2", "resumed/checkpoint-2",
                                                                     "full/checkpoint-1"))
        assert sorted(full) == sorted(resumed)
        moved = max((full[k] - before[k]).abs().max().item() for k in full)
        diff = max((full[k] - resumed[k]).abs().max().item() for k in full)
        # NOTE: a section read in another order (or AdamW's moments of one) moves a weight by about a step (1e-3) or
        # 0.1; the other layout's sums, through AdamW's update of rarely seen embedding rows, by 3e-5 at most
        assert moved > 1e-3 and diff < 1e-4, (arch, moved, diff)
    saved, resumed = (_weights(runs / "zamba2" / d) for d in ("full/checkpoint-2", "resumed/checkpoint-2"))
    assert sorted(saved) == sorted(resumed) and any(".shared_transformer." in k for k in saved)
    assert [k for k in saved if not torch.equal(saved[k], resumed[k])] == []
