"""Run inside one rank: what a transformers / PEFT user does with a loaded model, against transformers itself."""

import json
from pathlib import Path

import torch


def _ids(vocab: int, rows: int = 2, seq: int = 10):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (rows, seq), generator=g)


def model_api_checks(folders: dict, out: str) -> dict:
    import transformers

    import loongforge_hf as lf

    out, res = Path(out), {}

    # --- eval mode on return (dropout off), train mode once the engine trains -------------------------------------
    drop = folders["dropout"]
    model = lf.AutoModelForCausalLM.from_pretrained(drop, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(drop, dtype=torch.float32)
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        first, second, exp = model(input_ids=ids).logits, model(input_ids=ids).logits, ref(input_ids=ids).logits
    res["eval"] = {"training": model.training, "ref_training": ref.training,
                   "repeat_diff": (first - second).abs().max().item(), "vs_ref": (first - exp).abs().max().item()}
    from loongforge_hf.trainer.engine import MegatronEngine

    args = transformers.TrainingArguments(output_dir=str(out / "run"), learning_rate=1e-3, report_to=[], use_cpu=True)
    MegatronEngine(model, args=args).train_step([{"input_ids": ids, "labels": ids}])
    res["eval"]["training_after_step"] = model.training and all(m.training for m in model.modules())

    # --- dtype "auto" by default, as transformers 5 -------------------------------------------------------------------
    res["dtype"] = {}
    for name in ("bf16", "no_dtype_field"):
        m = lf.AutoModelForCausalLM.from_pretrained(folders[name])
        r = transformers.AutoModelForCausalLM.from_pretrained(folders[name])
        res["dtype"][name] = (str(m.dtype), str(r.dtype))

    # --- forward keywords ---------------------------------------------------------------------------------------------
    src = folders["qwen3"]
    model = lf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ids = _ids(model.config.vocab_size)
    labels = ids.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        got = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40))
        exp = ref(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40))
        kept = model(input_ids=ids, logits_to_keep=1)
        kept_ref = ref(input_ids=ids, logits_to_keep=1)
        as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    res["forward"] = {"num_items": (got.loss.item(), exp.loss.item()),
                      "keep_shape": (tuple(kept.logits.shape), tuple(kept_ref.logits.shape)),
                      "keep_diff": (kept.logits - kept_ref.logits).abs().max().item(),
                      "tuple": (type(as_tuple).__name__, len(as_tuple),
                                abs(as_tuple[0].item() - ref(input_ids=ids, labels=labels).loss.item()))}
    refused = {}
    cases = ({"output_hidden_states": True}, {"past_key_values": object()}, {"labels": labels, "logits_to_keep": 1})
    for kwargs in cases:
        try:
            model(input_ids=ids, **kwargs)
            refused[sorted(kwargs)[-1]] = None
        except (TypeError, ValueError) as e:
            refused[sorted(kwargs)[-1]] = f"{type(e).__name__}: {e}"
    res["forward"]["refused"] = refused
    res["num_parameters"] = (model.num_parameters(), ref.num_parameters())
    tied = lf.AutoModelForCausalLM.from_pretrained(folders["tied"], dtype=torch.float32)
    tied_ref = transformers.AutoModelForCausalLM.from_pretrained(folders["tied"], dtype=torch.float32)
    res["num_parameters_variants"] = [(m.num_parameters(*args), r.num_parameters(*args))
                                      for m, r in ((model, ref), (tied, tied_ref))
                                      for args in ((True, False), (False, True), (True, True))]

    # --- the embedding's own dropout (Phi-2's embd_pdrop 0.0 beside resid_pdrop 0.1; StarCoder2's alike); the LM
    # head's bias counted as transformers counts it (padding rows left out), tied or not; resizing refused -----------
    res["embedding_dropout"], res["num_parameters_bias"] = {}, []
    for name in ("starcoder2_dropouts", "phi_tied", "phi_dropouts"):
        m = lf.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32)
        r = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32)
        res["embedding_dropout"][name] = (m.chunks[0].embedding.embedding_dropout.p, m.megatron.config.hidden_dropout)
        if name.startswith("phi"):
            res["num_parameters_bias"] += [(m.num_parameters(*args), r.num_parameters(*args))
                                           for args in ((False, False), (True, False), (False, True))]
    try:
        m.resize_token_embeddings(300)
        res["resize_bias"] = None
    except NotImplementedError as e:
        res["resize_bias"] = str(e)

    # --- where dropouts fall, made deterministic by a probability of 1, in training mode on both sides: StableLM's
    # hidden_dropout on the MLP's output only, GPT-J's resid_pdrop on both sublayers' and not the embedding's -------
    res["dropout_placement"] = {}
    for name in ("stablelm_dropouts", "gptj_dropouts"):
        m = lf.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).train()
        r = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).train()
        with torch.no_grad():
            res["dropout_placement"][name] = float((m(input_ids=ids).logits - r(input_ids=ids).logits).abs().max())

    # --- save_pretrained: config / generation config follow the model, dtype follows the tensors ------------------
    model.save_pretrained(out / "same")
    same = (out / "same" / "config.json").read_bytes()
    res["same_config_verbatim"] = same == (Path(src) / "config.json").read_bytes()
    model.config.use_cache = False
    model.config.my_field = "kept"
    model.generation_config.max_new_tokens = 77
    model.save_pretrained(out / "changed", dtype=torch.bfloat16)
    cfg = json.loads((out / "changed" / "config.json").read_text())
    gen = json.loads((out / "changed" / "generation_config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(out / "changed")
    res["changed"] = {"use_cache": cfg.get("use_cache"), "my_field": cfg.get("my_field"), "dtype": cfg.get("dtype"),
                      "max_new_tokens": gen.get("max_new_tokens"), "reloaded_dtype": str(back.dtype),
                      "tensor_dtypes": sorted({str(p.dtype) for p in back.parameters()})}
    refused = {}
    for kwargs in ({"state_dict": {}}, {"push_to_hub": True}, {"safe_serialization": False}):
        try:
            model.save_pretrained(out / "refused", **kwargs)
            refused[next(iter(kwargs))] = None
        except TypeError as e:
            refused[next(iter(kwargs))] = str(e)
    model.save_pretrained(out / "accepted", safe_serialization=True, is_main_process=True)
    res["save_refused"] = refused
    res["save_refused_left_nothing"] = not (out / "refused").exists()

    # --- a bf16 checkpoint trained in fp32 is written with a config that says fp32 ---------------------------------
    m = lf.AutoModelForCausalLM.from_pretrained(folders["bf16"], dtype=torch.float32)
    m.save_pretrained(out / "bf16_as_fp32")
    res["bf16_as_fp32"] = json.loads((out / "bf16_as_fp32" / "config.json").read_text()).get("dtype")

    # --- extra chat templates are copied ------------------------------------------------------------------------------
    m = lf.AutoModelForCausalLM.from_pretrained(folders["templates"], dtype=torch.float32)
    m.save_pretrained(out / "templates")
    res["templates"] = sorted(p.name for p in (out / "templates" / "additional_chat_templates").iterdir())
    return res


def peft_auto_load(folder: str, out: str) -> dict:
    """A LoRA adapter folder loads with peft's AutoPeftModelForCausalLM (auto_mapping) and gives our logits."""
    from peft import AutoPeftModelForCausalLM, LoraConfig

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(model, lora)
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    model.save_pretrained(out)
    peft_model = AutoPeftModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    return {"diff": (ours - theirs).abs().max().item(),
            "auto_mapping": json.loads((Path(out) / "adapter_config.json").read_text()).get("auto_mapping")}
