"""Bad input to ``from_pretrained`` / ``save_pretrained`` on 2 CPU ranks: one clear error, alike on every rank, fast.

- Load cases: each must raise before the process group starts (``torch.distributed`` is still uninitialised when the
  error arrives, so no rank can be left waiting in a collective), with the same exception type and message on both
  ranks, naming the file, tensor or field. They all run in one 2-rank world: a pre-collective failure leaves nothing
  behind for the next case.
- Collective cases run in a second world: a pickle-only checkpoint loaded with ``allow_pickle=True`` (logits equal
  transformers'), then save failures (a crash at the Nth tensor, a full disk, an unusable destination, a bad
  ``max_shard_size`` or ``dtype``) that must raise the same error on every rank and leave no output and no temporary
  folder, and a save over an existing folder that must swap in the new weights at once (the old folder intact until
  the swap) and keep the folder's other files, as transformers' save_pretrained does (a tokenizer saved there first
  is not replaced by the source's; the old weight files go).
"""

import contextlib
import errno
import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TP2 = {"tensor_parallel_size": 2}
INDEX = "model.safetensors.index.json"
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# NOTE: per call, measured inside the rank after the imports; a hang would instead run into run_distributed's timeout.
QUICK_S = 10.0
LOAD_CASES = ("missing_shard", "corrupt_header", "truncated_shard", "index_escape", "shape_mismatch", "pickle_refused",
              "bloom", "foo_architecture", "unknown_model_type", "rope_dynamic", "sliding_window", "gemma_softcapping",
              "heads_vs_tp", "kv_replication", "world_size", "vpp_layers", "hub_id_not_cached", "gpt_oss_split_experts",
              "gpt_oss_alpha", "pad_token_id")


# ---- what runs inside each rank -------------------------------------------------------------------------------------

def _outcome(fn) -> dict:
    import time

    import torch.distributed as dist

    start = time.monotonic()
    try:
        fn()
        kind, message = "no error", ""
    except Exception as err:  # noqa: BLE001 - the test compares what each rank got
        kind, message = type(err).__name__, str(err)
    return {"type": kind, "message": message, "seconds": time.monotonic() - start,
            "collective_started": dist.is_initialized()}


def load_each(cases: dict) -> dict:
    """from_pretrained on every case in turn; {case: outcome}."""
    import megatron.core  # noqa: F401 - import cost stays out of the timings

    import loongforge_hf as lf

    return {name: _outcome(lambda: lf.AutoModelForCausalLM.from_pretrained(where, **kwargs))
            for name, (where, kwargs) in cases.items()}


@contextlib.contextmanager
def _patch_disk_writes(replacement, *, pass_real: bool = False):
    """Route both ways the writer puts tensor bytes on disk through ``replacement``: ``os.pwrite`` (a planned tensor,
    streamed) and safetensors' ``save_file`` (a buffered shard)."""
    from unittest import mock

    from loongforge_hf.bridges import writer as writer_module

    def through(real):
        return (lambda *args, **kwargs: replacement(real, *args, **kwargs)) if pass_real else replacement

    with mock.patch.object(writer_module, "save_file", through(writer_module.save_file)), \
            mock.patch.object(writer_module.os, "pwrite", through(os.pwrite)):
        yield


def pickle_load_then_saves(pickle_dir: str, out_root: str) -> dict:
    """Load a pickle checkpoint (opt-in) at TP=2, compare with transformers, then run the save cases in turn."""
    from unittest import mock

    import torch.distributed as dist

    import loongforge_hf as lf
    from loongforge_hf.bridges import writer as writer_module

    root = Path(out_root)
    results = {}
    model = lf.AutoModelForCausalLM.from_pretrained(pickle_dir, dtype=torch.float32, allow_pickle=True, **TP2)
    ref = transformers.AutoModelForCausalLM.from_pretrained(pickle_dir, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        results["logit_diff"] = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()

    real_add, real_add_part = writer_module.CheckpointWriter.add, writer_module.CheckpointWriter.add_part
    added = []

    def crash_at_fifth_tensor(self, name, tensor, **block):  # NOTE: whole tensors (add) and TP blocks (add_part)
        added.append(name)
        if len(added) == 5:
            raise RuntimeError(f"simulated crash while writing tensor #5 ({name})")
        (real_add_part(self, name, tensor, **block) if block else real_add(self, name, tensor))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with mock.patch.object(writer_module.CheckpointWriter, "add", crash_at_fifth_tensor), \
            mock.patch.object(writer_module.CheckpointWriter, "add_part", crash_at_fifth_tensor):
        results["crash"] = _outcome(lambda: model.save_pretrained(root / "crash", max_shard_size="20KB"))
    with _patch_disk_writes(disk_full):
        results["disk_full"] = _outcome(lambda: model.save_pretrained(root / "full", max_shard_size="20KB"))
        results["disk_full_existing"] = _outcome(lambda: model.save_pretrained(root / "existing"))
    results["unusable_destination"] = _outcome(lambda: model.save_pretrained(root / "blocked" / "out"))
    results["bad_shard_size"] = _outcome(lambda: model.save_pretrained(root / "sized", max_shard_size="lots"))
    results["bad_dtype"] = _outcome(lambda: model.save_pretrained(root / "typed", dtype="bf16"))

    # NOTE: while the new shards are written the old folder must still be whole; it is swapped only at the end.
    seen_during_save = []

    def watching(real, *args, **kwargs):
        seen_during_save.append(sorted(p.name for p in (root / "replace").iterdir()))
        return real(*args, **kwargs)

    with _patch_disk_writes(watching, pass_real=True):
        results["replace"] = _outcome(lambda: model.save_pretrained(root / "replace", max_shard_size="20KB"))
    results["seen_during_save"] = seen_during_save
    results["rank"] = dist.get_rank()
    return results


# ---- checkpoints ------------------------------------------------------------------------------------------------

def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def _weight_map(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())["weight_map"]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("base") / "llama", "llama")


@pytest.fixture(scope="module")
def load_cases(base, tmp_path_factory):
    """{case: (where, from_pretrained kwargs, expected error type, fragments the message must hold)}."""
    tmp = tmp_path_factory.mktemp("bad")
    wm = _weight_map(base)
    tensor = "model.layers.1.mlp.up_proj.weight"
    shard = wm[tensor]
    cases = {}

    missing = _copy(base, tmp / "missing_shard")
    (missing / shard).unlink()
    first_in_shard = next(t for t, s in wm.items() if s == shard)
    cases["missing_shard"] = (missing, TP2, "CheckpointError", [str(missing), shard, "missing", first_in_shard])

    corrupt = _copy(base, tmp / "corrupt_header")
    with open(corrupt / shard, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        f.write(b"{" + b"\xff" * (length - 1))  # same length, not JSON any more
    cases["corrupt_header"] = (corrupt, TP2, "CheckpointError",
                               [str(corrupt / shard), "corrupt safetensors header"])

    truncated = _copy(base, tmp / "truncated_shard")
    data = (truncated / shard).read_bytes()
    (truncated / shard).write_bytes(data[: len(data) - 100])
    cases["truncated_shard"] = (truncated, TP2, "CheckpointError", [str(truncated / shard), "truncated"])

    escape = _copy(base, tmp / "index_escape")
    # NOTE: the file outside exists and holds the tensor, so only the path itself can be the reason for refusing.
    save_file({tensor: load_file(base / shard)[tensor]}, str(tmp / "x.safetensors"))
    index = json.loads((escape / INDEX).read_text())
    index["weight_map"][tensor] = "../x.safetensors"
    (escape / INDEX).write_text(json.dumps(index))
    cases["index_escape"] = (escape, TP2, "CheckpointError", [INDEX, "'../x.safetensors'", tensor,
                                                              "leaves the checkpoint folder"])

    shapes = _copy(base, tmp / "shape_mismatch")
    _edit_json(shapes / "config.json", intermediate_size=128)
    cases["shape_mismatch"] = (shapes, TP2, "CheckpointError",
                               ["model.layers.0.mlp.gate_proj.weight", "expected shape (128, 64), found (96, 64)",
                                "model.layers.3.mlp.down_proj.weight", "expected shape (64, 128), found (64, 96)",
                                "config.json"])

    pickled = tmp / "pickle_only"
    _save_pickle_checkpoint(base, pickled)
    cases["pickle_refused"] = (pickled, TP2, "CheckpointError", [str(pickled), "pytorch_model.bin",
                                                                 "allow_pickle=True"])

    bloom = tmp / "bloom"  # NOTE: a real transformers architecture without a bridge (BLOOM's ALiBi), refused by name
    torch.manual_seed(0)
    transformers.BloomForCausalLM(transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=2,
                                                           vocab_size=99)).save_pretrained(bloom)
    cases["bloom"] = (bloom, TP2, "UnsupportedArchitectureError", ["BloomForCausalLM is not supported", "ALiBi",
                                                                   *SUPPORTED])

    foo = _copy(base, tmp / "foo")
    _edit_json(foo / "config.json", architectures=["FooForCausalLM"])
    cases["foo_architecture"] = (foo, TP2, "UnsupportedArchitectureError", ["FooForCausalLM", *SUPPORTED])

    unknown = _copy(base, tmp / "unknown_model_type")
    _edit_json(unknown / "config.json", model_type="foo", architectures=["FooForCausalLM"])
    cases["unknown_model_type"] = (unknown, TP2, "ValueError", ["`foo`"])  # transformers' own AutoConfig error

    dynamic = make_tiny_checkpoint(tmp / "dynamic", "llama", tokenizer=False, num_hidden_layers=2,
                                   rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    cases["rope_dynamic"] = (dynamic, TP2, "UnsupportedConfigError",
                             ["rope_type='dynamic'", "'default'", "'llama3'", "'yarn'"])

    window = make_tiny_checkpoint(tmp / "sliding", "qwen2", tokenizer=False, use_sliding_window=True, sliding_window=6,
                                  max_window_layers=0)
    cases["sliding_window"] = (window, TP2, "UnsupportedConfigError", ["use_sliding_window=True"])

    capped = make_tiny_checkpoint(tmp / "gemma_softcapping", "gemma3", tokenizer=False, attn_logit_softcapping=50.0)
    cases["gemma_softcapping"] = (capped, TP2, "UnsupportedConfigError", ["attn_logit_softcapping=50.0",
                                                                          "soft-capping"])

    heads = make_tiny_checkpoint(tmp / "heads3", "qwen3", tokenizer=False, num_attention_heads=3, num_key_value_heads=1)
    cases["heads_vs_tp"] = (heads, TP2, "ParallelLayoutError", ["num_attention_heads=3", "tensor_parallel_size=2"])
    # NOTE: one KV head at TP2 is replicated, but OLMo 2's k norm over all KV heads cannot be (kv_replicas.py)
    k_norm = make_tiny_checkpoint(tmp / "olmo2_kv1", "olmo2", tokenizer=False, num_key_value_heads=1)
    cases["kv_replication"] = (k_norm, TP2, "ParallelLayoutError", ["tensor_parallel_size=2 is more than the 1 KV "
                                                                    "heads of Olmo2ForCausalLM", "k_layernorm"])

    cases["world_size"] = (base, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "ParallelLayoutError",
                           ["World size 2", "tensor_parallel_size (2)", "pipeline_parallel_size (2)", "= 4"])

    six = make_tiny_checkpoint(tmp / "six_layers", "llama", tokenizer=False, num_hidden_layers=6)
    cases["vpp_layers"] = (six, {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2},
                           "ParallelLayoutError", ["num_hidden_layers=6", "pipeline_parallel_size (2)",
                                                   "virtual_pipeline_parallel_size (2)", "= 4"])

    empty_cache = tmp / "empty_hf_cache"
    empty_cache.mkdir()
    cases["hub_id_not_cached"] = ("loongforge-tests/not-in-any-cache", {**TP2, "cache_dir": str(empty_cache)},
                                  "CheckpointError", ["'loongforge-tests/not-in-any-cache'", "offline mode on",
                                                      str(empty_cache)])

    gpt_oss = make_tiny_checkpoint(tmp / "gpt_oss", "gpt_oss", tokenizer=False)
    cases["gpt_oss_split_experts"] = (gpt_oss, {**TP2, "sequence_parallel": True, "expert_tensor_parallel_size": 2},
                                      "ParallelLayoutError", ["expert_tensor_parallel_size=2 is not supported",
                                                              "GptOssForCausalLM", "expert biases"])
    alpha = make_tiny_checkpoint(tmp / "gpt_oss_alpha", "gpt_oss", tokenizer=False,
                                 swiglu_alpha=1.5)
    cases["gpt_oss_alpha"] = (alpha, TP2, "UnsupportedConfigError", ["swiglu_alpha=1.5", "1.702"])
    # NOTE: transformers builds the embedding with padding_idx=pad_token_id (bridges/embedding_padding.py)
    pad = _copy(base, tmp / "pad_outside_vocabulary")
    _edit_json(pad / "config.json", pad_token_id=203)
    cases["pad_token_id"] = (pad, TP2, "ValueError", ["pad_token_id=203", "vocab_size=203"])
    assert tuple(cases) == LOAD_CASES
    return cases


def _save_pickle_checkpoint(src: Path, dst: Path) -> None:
    """``src`` as transformers 4's ``save_pretrained(safe_serialization=False)`` wrote it: one pytorch_model.bin.

    NOTE: transformers 5 writes safetensors only, but still loads this layout.
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    dst.mkdir()
    torch.save(model.state_dict(), dst / "pytorch_model.bin")
    model.config.save_pretrained(dst)


@pytest.fixture(scope="module")
def load_outcomes(load_cases):
    calls = {name: (str(where), dict(kwargs)) for name, (where, kwargs, _, _) in load_cases.items()}
    return run_distributed(load_each, 2, calls, timeout=120, env={"HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize("case", LOAD_CASES)
def test_load_fails_alike_on_every_rank_before_any_collective(load_cases, load_outcomes, case):
    _, _, want_type, fragments = load_cases[case]
    rank0, rank1 = (outcomes[case] for outcomes in load_outcomes)
    assert rank0["type"] == want_type, rank0
    assert (rank1["type"], rank1["message"]) == (rank0["type"], rank0["message"])
    for fragment in fragments:
        assert fragment in rank0["message"], (fragment, rank0["message"])
    for outcome in (rank0, rank1):
        assert not outcome["collective_started"], "the error came after the process group started"
        assert outcome["seconds"] < QUICK_S, outcome


# ---- the collective cases ---------------------------------------------------------------------------------------

def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _read_weights(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def save_run(base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("save")
    pickled = tmp / "pickle_only"
    _save_pickle_checkpoint(base, pickled)
    root = tmp / "out"
    root.mkdir()
    existing = _copy(base, root / "existing")
    (existing / "notes.txt").write_text("the user's notes")
    replace = _copy(base, root / "replace")
    (replace / "notes.txt").write_text("the user's notes")
    (replace / "runs").mkdir()
    (replace / "runs" / "events.log").write_text("the user's logs")
    (replace / "tokenizer_config.json").write_text('{"the user\'s": "tokenizer"}')
    (replace / "model-00001-of-00099.safetensors").write_bytes(b"left from an older save")
    (root / "blocked").write_text("a file where the destination's parent folder should be")
    before = {"existing": _snapshot(existing), "replace": sorted(p.name for p in replace.iterdir())}
    results = run_distributed(pickle_load_then_saves, 2, str(pickled), str(root), timeout=150)
    return root, before, results


def test_pickle_checkpoint_loads_when_allowed(save_run):
    _, _, results = save_run
    for r in results:
        assert r["logit_diff"] < 1e-4, r["logit_diff"]


@pytest.mark.parametrize("case, out, want_type, fragments", [
    ("crash", "crash", "RuntimeError", ["simulated crash while writing tensor #5"]),
    ("disk_full", "full", "RuntimeError", ["disk full while writing shard-00001.safetensors"]),
    ("disk_full_existing", "existing", "RuntimeError", ["disk full while writing shard-00001.safetensors"]),
    ("unusable_destination", "blocked/out", "RuntimeError", ["CheckpointError: could not write"]),
    ("bad_shard_size", "sized", "ValueError", ["'lots'"]),
    ("bad_dtype", "typed", "TypeError", ["dtype", "'bf16'"]),
])
def test_failed_save_raises_alike_and_leaves_nothing(save_run, case, out, want_type, fragments):
    root, before, results = save_run
    rank0, rank1 = (r[case] for r in results)
    assert rank0["type"] == want_type, rank0
    assert (rank1["type"], rank1["message"]) == (rank0["type"], rank0["message"])
    for fragment in fragments + ([str(root / out)] if want_type == "RuntimeError" else []):
        assert fragment in rank0["message"], (fragment, rank0["message"])
    for outcome in (rank0, rank1):
        assert outcome["seconds"] < QUICK_S, outcome
    if case == "disk_full_existing":
        assert _snapshot(root / "existing") == before["existing"]
    else:
        assert not (root / out).exists()
    leftovers = sorted(p.name for p in root.rglob(".*") if re.search(r"\.(tmp|old)-", p.name))
    assert leftovers == []


def test_save_over_existing_folder_swaps_weights_and_keeps_other_files(base, save_run):
    root, before, results = save_run
    rank0, rank1 = (r["replace"] for r in results)
    assert rank0["type"] == rank1["type"] == "no error", (rank0, rank1)
    seen = results[0]["seen_during_save"]
    assert len(seen) > 1 and all(names == before["replace"] for names in seen), seen
    out = root / "replace"
    files = sorted(p.name for p in out.iterdir())
    assert INDEX in files and "model.safetensors" not in files and "model-00001-of-00099.safetensors" not in files
    weight_files = {p.name for p in out.glob("*.safetensors")}
    assert weight_files == set(json.loads((out / INDEX).read_text())["weight_map"].values())
    assert (out / "notes.txt").read_text() == "the user's notes"
    assert (out / "runs" / "events.log").read_text() == "the user's logs"
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"the user's": "tokenizer"}
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    new, src = _read_weights(root / "replace"), _read_weights(base)
    assert sorted(new) == sorted(src)
    for name in src:
        assert torch.equal(new[name], src[name]), name


@pytest.mark.parametrize("arch,name", [("ministral", "MinistralForCausalLM"), ("gemma2", "Gemma2ForCausalLM"),
                                       ("gemma3", "Gemma3ForCausalLM"), ("olmo3", "Olmo3ForCausalLM"),
                                       ("vaultgemma", "VaultGemmaForCausalLM"), ("cwm", "CwmForCausalLM")])
def test_layer_types_other_than_full_and_sliding_refused(arch, name):
    """A layer kind the bridges do not implement (Llama 4's chunked attention) is refused by the bridge's pure check,
    which from_pretrained runs before any collective, naming the kinds it takes."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.testing.tiny_models import _config

    config = _config(arch)
    config.architectures = [name]
    config.layer_types = ["chunked_attention", *config.layer_types[1:]]
    with pytest.raises(UnsupportedConfigError, match=rf"layer_types \['chunked_attention'\] are not supported for "
                                                     rf"{name}; supported: \['full_attention', 'sliding_attention'\]"):
        get_bridge(config)


def test_starcoder2_dropouts_taken_apart():
    """StarCoder2's ``embedding_dropout`` other than its ``residual_dropout`` (megatron's ``hidden_dropout``) is the
    embedding's own dropout (``embedding_dropout``, set by the builder: test_model_api.py), not refused."""
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    config = _config("starcoder2", residual_dropout=0.1, embedding_dropout=0.0)
    config.architectures = ["Starcoder2ForCausalLM"]
    bridge = get_bridge(config)
    kw = bridge.transformer_config_kwargs()
    assert kw["hidden_dropout"] == 0.1 and bridge.embedding_dropout == 0.0
    assert kw["normalization"] == "LayerNorm" and kw["layernorm_epsilon"] == 1e-5
    assert kw["add_bias_linear"] and kw["add_qkv_bias"] and not kw["gated_linear_unit"]


@pytest.mark.parametrize("arch,name,fields,expected", [
    ("phi", "PhiForCausalLM", {"resid_pdrop": 0.1, "embd_pdrop": 0.0}, 0.0),
    ("starcoder2", "Starcoder2ForCausalLM", {"residual_dropout": 0.1, "embedding_dropout": 0.2}, 0.2),
    ("phi3", "Phi3ForCausalLM", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}, 0.0),  # NOTE: transformers reads no embd_pdrop
    ("seed_oss", "SeedOssForCausalLM", {"residual_dropout": 0.1}, 0.0)])
def test_embedding_dropout_as_transformers_drops(arch, name, fields, expected):
    """The embedding output's dropout where transformers' differs from its sublayers' (megatron's ``hidden_dropout``,
    0.1 here): Phi's ``embd_pdrop``, StarCoder2's ``embedding_dropout``, none in Phi-3's and Seed-OSS's; the builder
    sets it on megatron's embedding (tests/bridges/test_model_api.py)."""
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config(arch, **fields, architectures=[name]))
    assert bridge.transformer_config_kwargs()["hidden_dropout"] == 0.1 and bridge.embedding_dropout == expected


def test_phi_rope_megatron_cannot_express_refused():
    """Phi with a rope type other than default / llama3 (dynamic NTK, YaRN) or a partial rotary factor outside (0, 1]:
    refused by the bridge's pure check, naming the field; phi-2's settings are taken (0.4 of each head rotated, one
    norm before both sublayers, the LM head's bias, its own embedding dropout, q / k LayerNorms when asked)."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.testing.tiny_models import _config

    for rope, match in (({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.4},
                         r"rope_type='dynamic' is not implemented; supported: \['default', 'llama3'\]"),
                        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "partial_rotary_factor": 0.4,
                          "original_max_position_embeddings": 32}, r"rope_type='yarn' is not implemented"),
                        ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5},
                         r"partial_rotary_factor=1.5: expected a value in \(0, 1\]")):
        with pytest.raises(UnsupportedConfigError, match=match):
            get_bridge(_config("phi", rope_parameters=rope, architectures=["PhiForCausalLM"]))
    bridge = get_bridge(_config("phi", resid_pdrop=0.1, embd_pdrop=0.0, qk_layernorm=True,
                                architectures=["PhiForCausalLM"]))
    kw = bridge.transformer_config_kwargs()
    assert kw["hidden_dropout"] == 0.1 and bridge.embedding_dropout == 0.0 and bridge.lm_head_bias
    assert kw["normalization"] == "LayerNorm" and kw["qk_layernorm"] and not kw["gated_linear_unit"]
    assert bridge.parallel_residual == "shared" and bridge.rope_parameters()["partial_rotary_factor"] == 0.4
    assert "lm_head.bias" in bridge.expected_hf_shapes()


def test_gpt_neox_attention_without_biases_refused():
    """GPT-NeoX with ``attention_bias=False`` keeps its MLP biases; megatron gives the attention output projection a
    bias exactly when the MLP's linears have one: refused by the bridge's pure check, naming the field."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.testing.tiny_models import _config

    config = _config("gpt_neox", attention_bias=False)
    config.architectures = ["GPTNeoXForCausalLM"]
    with pytest.raises(UnsupportedConfigError, match=r"attention_bias=False is not supported for GPTNeoXForCausalLM"):
        get_bridge(config)
    config.attention_bias = True
    kw = get_bridge(config).transformer_config_kwargs()
    assert kw["normalization"] == "LayerNorm" and kw["add_bias_linear"] and not kw["gated_linear_unit"]
    assert get_bridge(config).parallel_residual == "separate"
    config.use_parallel_residual = False
    assert get_bridge(config).parallel_residual is None


@pytest.mark.parametrize("arch", ["cohere", "cohere2"])
def test_cohere_fields_megatron_cannot_express_refused(arch):
    """Cohere / Cohere2 with ``attention_bias=True`` (a bias on o_proj, none in the MLP: megatron's output projection
    has one exactly when the MLP's linears do), Cohere's ``logit_scale=None`` (transformers' forward cannot run;
    Cohere2's config refuses it itself) or YaRN: refused by the bridge's pure check, naming the field; the hub's
    settings are taken."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.testing.tiny_models import _config

    name = "CohereForCausalLM" if arch == "cohere" else "Cohere2ForCausalLM"
    cases = [("attention_bias", True, rf"attention_bias=True is not supported for {name}"),
             ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                  "original_max_position_embeddings": 32}, r"rope_type='yarn' is not implemented")]
    if arch == "cohere":
        cases.append(("logit_scale", None, rf"logit_scale=None is not supported for {name}"))
    for field, value, match in cases:
        config = _config(arch, **{field: value}, architectures=[name])
        with pytest.raises(UnsupportedConfigError, match=match):
            get_bridge(config)
    bridge = get_bridge(_config(arch, architectures=[name]))
    kw = bridge.transformer_config_kwargs()
    assert kw["normalization"] == "LayerNorm" and kw["rotary_interleaved"] and not kw["qk_layernorm"]
    assert bridge.parallel_residual == "shared" and not bridge.norm_bias and bridge.tied
    assert (bridge.qk_module() is not None) == (arch == "cohere")
    if arch == "cohere2":
        assert kw["window_size"] == (4, 0) and kw["window_attn_skip_freq"] == [1, 1, 1, 0]


def test_gptj_fields_megatron_cannot_express_refused():
    """GPT-J with an odd ``rotary_dim`` or one wider than a head (transformers' forward fails on both), or an
    activation the shared table lacks: refused by the bridge's pure check,
    naming the field; the hub's settings are taken (no attention biases, the MLP's built with them, the LM head's
    bias, interleaved pairs over ``rotary_dim`` channels: 30 of 44 too, which ``rotary_dim / head_dim`` alone gives
    megatron one short), the three dropouts each where transformers puts it; ``token_type_ids`` are refused by the
    forward (transformers adds their embeddings)."""
    import types

    import torch

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.bridges.gptj import biased_mlp
    from loongforge_hf.modeling import LoongModelForCausalLM
    from loongforge_hf.testing.tiny_models import _config

    name = "GPTJForCausalLM"
    for field, value, match in (("rotary_dim", 5, r"rotary_dim=5 is not supported for GPTJForCausalLM"),
                                ("rotary_dim", 18, r"rotary_dim=18 is not supported.*\(0, 16\]"),
                                ("activation_function", "relu", r"hidden_act='relu' is not supported")):
        with pytest.raises(UnsupportedConfigError, match=match):
            get_bridge(_config("gptj", **{field: value}, architectures=[name]))
    bridge = get_bridge(_config("gptj", resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3, n_inner=None,
                                architectures=[name]))
    kw = bridge.transformer_config_kwargs()
    assert kw["hidden_dropout"] == 0.1 and bridge.embedding_dropout == 0.2 and kw["attention_dropout"] == 0.3
    assert kw["normalization"] == "LayerNorm" and kw["rotary_interleaved"] and not kw["gated_linear_unit"]
    assert not kw["add_bias_linear"] and not kw["add_qkv_bias"] and bridge.mlp_module() is biased_mlp()
    assert kw["ffn_hidden_size"] == 256 and kw["layernorm_epsilon"] == 1e-5 and bridge.lm_head_bias
    assert bridge.parallel_residual == "shared" and "transformer.h.3.mlp.fc_in.bias" in bridge.expected_hf_shapes()
    assert int(16 * bridge.rope_parameters()["partial_rotary_factor"]) == 6
    wide = get_bridge(_config("gptj", n_embd=176, rotary_dim=30, architectures=[name]))
    assert int(44 * wide.rope_parameters()["partial_rotary_factor"]) == 30 and int(44 * (30 / 44)) == 29
    with pytest.raises(TypeError, match=r"token_type_ids are not supported for GPTJForCausalLM"):
        LoongModelForCausalLM.forward(types.SimpleNamespace(bridge=bridge), torch.zeros(1, 3, dtype=torch.long),
                                      token_type_ids=torch.zeros(1, 3, dtype=torch.long))


def test_stablelm_fields_megatron_cannot_express_refused():
    """StableLM with a rope type other than default / llama3: refused by the bridge's pure check, naming the field;
    the hub's settings are taken: StableLM 2 12B's (one norm before both sublayers, per-head q / k LayerNorms) and
    1.6B's (sequential, q / k / v biases); ``hidden_dropout`` drops the MLP's output only (megatron's
    ``hidden_dropout``, both sublayers', stays 0) and nothing drops the embedding output."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.bridges.cohere import per_head_layer_norm
    from loongforge_hf.bridges.stablelm import dropped_mlp
    from loongforge_hf.testing.tiny_models import _config

    name = "StableLmForCausalLM"
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "partial_rotary_factor": 0.25,
            "original_max_position_embeddings": 32}
    with pytest.raises(UnsupportedConfigError, match=r"rope_type='yarn' is not implemented"):
        get_bridge(_config("stablelm", rope_parameters=rope, architectures=[name]))
    big = get_bridge(_config("stablelm", use_qkv_bias=False, hidden_dropout=0.1, architectures=[name]))
    kw = big.transformer_config_kwargs()
    assert kw["hidden_dropout"] == 0.0 and big.embedding_dropout == 0.0 and big.mlp_module() is dropped_mlp(0.1)
    assert kw["normalization"] == "LayerNorm" and not kw["add_qkv_bias"] and not kw["qk_layernorm"]
    assert big.parallel_residual == "shared" and big.qk_module() == (per_head_layer_norm("q"), per_head_layer_norm("k"))
    assert "model.layers.0.self_attn.k_layernorm.norms.1.weight" in big.expected_hf_shapes()
    small = get_bridge(_config("stablelm", qk_layernorm=False, use_parallel_residual=False, architectures=[name]))
    kw = small.transformer_config_kwargs()
    assert kw["add_qkv_bias"] and small.parallel_residual is None and small.qk_module() is None
    assert small.mlp_module() is None and small.rope_parameters()["partial_rotary_factor"] == 0.25
    assert "model.layers.0.post_attention_layernorm.bias" in small.expected_hf_shapes()


def test_glm_olmo_nemotron_fields_megatron_cannot_express_refused():
    """OLMo with ``attention_bias`` (o_proj's bias without the MLP's), a ``clip_qkv`` that is not a positive number, or
    ``clip_qkv`` with YaRN (its attention factor would scale q / k before the clamp); Nemotron with biases or YaRN:
    refused by the bridges' pure checks, naming the field. The hub's settings translate: GLM's interleaved half
    rotary with q / k / v biases, OLMo's parameterless norms and clamp, Nemotron's LayerNorm1P and ungated relu2."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.bridges.olmo import clipped_attention
    from loongforge_hf.testing.tiny_models import _config

    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}
    olmo = ["OlmoForCausalLM"]
    for overrides, field in (({"attention_bias": True}, "attention_bias=True"), ({"clip_qkv": 0.0}, "clip_qkv=0.0"),
                             ({"clip_qkv": -1.0}, "clip_qkv=-1.0"), ({"rope_parameters": yarn}, "clip_qkv=0.25 with")):
        with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
            get_bridge(_config("olmo", architectures=olmo, **overrides))
    assert get_bridge(_config("olmo", architectures=olmo, clip_qkv=None, rope_parameters=yarn)).qk_module() is not None
    bridge = get_bridge(_config("olmo", architectures=olmo))
    kw = bridge.transformer_config_kwargs()
    assert kw["normalization"] == "LayerNorm" and kw["layernorm_epsilon"] == 1e-5 and not kw["add_bias_linear"]
    assert bridge.attention_module() is clipped_attention(0.25) and bridge.norm_weight is False
    assert not any("norm" in name for name in bridge.expected_hf_shapes())
    nemotron = ["NemotronForCausalLM"]
    for overrides, field in (({"mlp_bias": True}, "mlp_bias=True"), ({"attention_bias": True}, "attention_bias=True"),
                             ({"rope_parameters": {**yarn, "partial_rotary_factor": 0.5}}, "rope_type='yarn'")):
        with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
            get_bridge(_config("nemotron", architectures=nemotron, **overrides))
    kw = get_bridge(_config("nemotron", architectures=nemotron)).transformer_config_kwargs()
    assert kw["layernorm_zero_centered_gamma"] and kw["normalization"] == "LayerNorm" and not kw["gated_linear_unit"]
    assert kw["kv_channels"] == 24 and kw["layernorm_epsilon"] == 1e-5
    kw = get_bridge(_config("glm", architectures=["GlmForCausalLM"])).transformer_config_kwargs()
    assert kw["rotary_interleaved"] and kw["add_qkv_bias"] and kw["normalization"] == "RMSNorm"


def test_small_causal_lm_fields_megatron_cannot_express_refused():
    """HunYuan dense with ``attention_bias`` or dynamic NTK without ``alpha``, Apertus with a bias, FlexOlmo with
    ``clip_qkv``: refused by the bridges' pure checks, naming the field. The hub's settings translate: HunYuan's
    NTK-alpha base, Apertus's xIELU (no activation in megatron's config: the MLP module's own), Granite MoE's shared
    MLP as megatron's shared experts (none at ``shared_intermediate_size=0``), and an EXAONE 3 config that transformers
    saved (``LlamaForCausalLM``, ``model_type="exaone"``) to the EXAONE bridge, its names the hub's."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.bridges.apertus import xielu_mlp
    from loongforge_hf.testing.tiny_models import _config

    def bridge(arch, name, **overrides):
        return get_bridge(_config(arch, architectures=[name], **overrides))

    hunyuan = ("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM")
    for overrides, field in (({"attention_bias": True}, "attention_bias=True"),
                             ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
                              "rope_type='dynamic' without alpha")):
        with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
            bridge(*hunyuan, **overrides)
    assert bridge(*hunyuan).rope_parameters()["rope_theta"] == pytest.approx(1e4 * 1000.0 ** (24 / 22))
    with pytest.raises(UnsupportedConfigError, match=re.escape("attention_bias=True")):
        bridge("apertus", "ApertusForCausalLM", attention_bias=True)
    with pytest.raises(UnsupportedConfigError, match=re.escape("clip_qkv=8.0")):
        bridge("flex_olmo", "FlexOlmoForCausalLM", clip_qkv=8.0)
    apertus = bridge("apertus", "ApertusForCausalLM")
    assert apertus.mlp_module() is xielu_mlp() and "activation_func" not in apertus.transformer_config_kwargs()
    assert bridge("apertus", "ApertusForCausalLM", hidden_act="relu2").mlp_module() is None
    shared = bridge("granitemoeshared", "GraniteMoeSharedForCausalLM")
    assert shared.transformer_config_kwargs()["moe_shared_expert_intermediate_size"] == 48
    plain = bridge("granitemoeshared", "GraniteMoeSharedForCausalLM", shared_intermediate_size=0)
    assert plain.transformer_config_kwargs()["moe_shared_expert_intermediate_size"] is None
    assert not any("shared_mlp" in n for n in plain.expected_hf_shapes())
    exaone = bridge("exaone", "LlamaForCausalLM")
    assert type(exaone).__name__ == "ExaoneBridge"
    assert "transformer.h.0.mlp.c_fc_0.weight" in exaone.expected_hf_shapes()


def test_small_dense_fields_megatron_cannot_express_refused():
    """Ministral 3's Llama 4 query scale (not built) refuses sequences that reach it (32 positions in the fixture),
    naming the field; VaultGemma with attention biases, CWM with windowed layers and no window, NanoChat with
    attention biases or YaRN (its attention factor undone by the q / k norms after the rotation): refused by the
    bridges' pure checks, naming the field."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.testing.tiny_models import _config

    def bridge(arch, name, **overrides):
        return get_bridge(_config(arch, architectures=[name], **overrides))

    ministral = bridge("ministral3", "Ministral3ForCausalLM")
    ministral.check_sequence_length(32)
    with pytest.raises(ValueError, match=re.escape("llama_4_scaling_beta=0.1")):
        ministral.check_sequence_length(33)
    plain = {"rope_type": "default", "rope_theta": 1e6}
    without = bridge("ministral3", "Ministral3ForCausalLM", rope_parameters=plain)
    without.check_sequence_length(10 ** 6)
    with pytest.raises(UnsupportedConfigError, match=re.escape("attention_bias=True")):
        bridge("vaultgemma", "VaultGemmaForCausalLM", attention_bias=True)
    with pytest.raises(UnsupportedConfigError, match=re.escape("sliding_window=0 with sliding_attention layers")):
        bridge("cwm", "CwmForCausalLM", sliding_window=0)
    with pytest.raises(UnsupportedConfigError, match=re.escape("attention_bias=True")):
        bridge("nanochat", "NanoChatForCausalLM", attention_bias=True)
    with pytest.raises(UnsupportedConfigError, match=re.escape("rope_type='yarn'")):
        bridge("nanochat", "NanoChatForCausalLM", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                                   "factor": 4.0,
                                                                   "original_max_position_embeddings": 32})


def test_falcon_fields_megatron_cannot_express_refused():
    """Falcon with ALiBi (megatron has none), a layout transformers' forward cannot run (the new decoder architecture
    without ``parallel_attn`` or with three norms, two norms in the older layout, the older layout's ``num_kv_heads``
    other than its heads, KV groups that do not divide the heads), dropouts megatron puts elsewhere, an activation the
    shared table lacks or dynamic rope scaling: refused by the bridge's pure check, naming the field; the hub's
    settings are taken (40B's two norms side by side, Falcon2-11B's and 7B's one, the sequential layer; 1, the groups
    or every head as KV heads; biases with ``bias``); one KV head at TP 2 passes the layout checks (replicated on both
    ranks: tests/parallel/test_kv_replicas.py)."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel.kv_replicas import check_kv_replication
    from loongforge_hf.bridges.config_map import kv_heads_of
    from loongforge_hf.parallel import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    name = "FalconForCausalLM"
    cases = [("falcon", {"alibi": True}, rf"alibi=True is not supported for {name}"),
             ("falcon", {"parallel_attn": False}, r"parallel_attn=False with new_decoder_architecture=True"),
             ("falcon", {"num_ln_in_parallel_attn": 3}, r"num_ln_in_parallel_attn=3 is not supported"),
             ("falcon_mqa", {"num_ln_in_parallel_attn": 2}, r"num_ln_in_parallel_attn=2 with new_decoder_arch"),
             ("falcon_mqa", {"multi_query": False, "num_kv_heads": 2}, r"num_kv_heads=2 with multi_query=False"),
             ("falcon", {"num_kv_heads": 3}, r"num_kv_heads=3 is not supported.*divide num_attention_heads=4"),
             ("falcon", {"hidden_dropout": 0.1}, r"hidden_dropout=0.1 is not supported .* side by side"),
             ("falcon_mqa", {"parallel_attn": False, "attention_dropout": 0.1},
              r"attention_dropout=0.1 with hidden_dropout=0.0 is not supported"),
             ("falcon", {"activation": "relu"}, r"activation='relu' is not supported for FalconForCausalLM"),
             ("falcon", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
              r"rope_type='dynamic' is not implemented")]
    for arch, overrides, match in cases:
        with pytest.raises(UnsupportedConfigError, match=match):
            get_bridge(_config(arch, **overrides, architectures=[name]))
    big = get_bridge(_config("falcon", architectures=[name]))
    kw = big.transformer_config_kwargs()
    assert big.parallel_residual == "separate" and kw["num_query_groups"] == 2 and kw["add_bias_linear"]
    assert kw["add_qkv_bias"] and kw["normalization"] == "LayerNorm" and not kw["gated_linear_unit"]
    assert kw["ffn_hidden_size"] == 96 and kw["layernorm_epsilon"] == 1e-5 and kw["attention_dropout"] == 0.0
    shapes = big.expected_hf_shapes()
    assert shapes["transformer.h.0.self_attention.query_key_value.weight"] == (128, 64) and big.tied
    assert "transformer.h.0.ln_mlp.bias" in shapes and "lm_head.weight" not in shapes
    falcon2 = get_bridge(_config("falcon", num_ln_in_parallel_attn=1, architectures=[name]))
    assert falcon2.parallel_residual == "shared" and "transformer.h.0.input_layernorm.weight" in \
        falcon2.expected_hf_shapes()
    small = get_bridge(_config("falcon_mqa", architectures=[name]))
    kw = small.transformer_config_kwargs()
    assert small.parallel_residual == "shared" and kw["num_query_groups"] == 1 and not kw["add_bias_linear"]
    shapes = small.expected_hf_shapes()
    assert shapes["transformer.h.0.self_attention.query_key_value.weight"] == (96, 64) and "lm_head.weight" in shapes
    assert not any(n.endswith("dense.bias") for n in shapes)
    sequential = get_bridge(_config("falcon_mqa", parallel_attn=False, multi_query=False, hidden_dropout=0.1,
                                    attention_dropout=0.1, architectures=[name]))
    kw = sequential.transformer_config_kwargs()
    assert sequential.parallel_residual is None and kw["num_query_groups"] == 4 and kw["hidden_dropout"] == 0.1
    assert kw["attention_dropout"] == 0.0 and sequential.embedding_dropout == 0.0
    assert "transformer.h.0.post_attention_layernorm.weight" in sequential.expected_hf_shapes()
    config = _config("falcon_mqa", architectures=[name])
    ParallelConfig(tensor_parallel_size=2).check_model(num_layers=4, num_attention_heads=4,
                                                       num_key_value_heads=kv_heads_of(config))
    check_kv_replication(get_bridge(config), ParallelConfig(tensor_parallel_size=2))


def test_gpt_bigcode_fields_megatron_cannot_express_refused():
    """GPTBigCode with unscaled scores, cross-attention or an activation the shared table lacks: refused by the
    bridge's pure check, naming the field; the hub's settings are taken (one KV head with ``multi_query``, whatever a
    stale ``num_key_value_heads`` says, every head without it; ``n_inner`` None as 4 x ``n_embd``, the three dropouts,
    LayerNorms and biases, learned positions, the tied head); one KV head at TP 2 passes the layout checks (replicated:
    tests/parallel/test_kv_replicas.py). The two
    softmax-in-fp32 flags are taken either way: transformers' attention does not read them (its fp32 logits are the
    same bit for bit with both off). ``token_type_ids`` are refused by the forward."""
    import types

    import torch
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel.kv_replicas import check_kv_replication
    from loongforge_hf.bridges.config_map import gelu_tanh, kv_heads_of
    from loongforge_hf.modeling import LoongModelForCausalLM
    from loongforge_hf.parallel import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    name = "GPTBigCodeForCausalLM"
    for field, value, match in (("scale_attn_weights", False, rf"scale_attn_weights=False is not supported for {name}"),
                                ("add_cross_attention", True, r"add_cross_attention=True is not supported"),
                                ("activation_function", "relu", r"hidden_act='relu' is not supported")):
        with pytest.raises(UnsupportedConfigError, match=match):
            get_bridge(_config("gpt_bigcode", **{field: value}))
    mqa = get_bridge(_config("gpt_bigcode", resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3, n_inner=None))
    kw = mqa.transformer_config_kwargs()
    assert kw["num_query_groups"] == 1 and kw["hidden_dropout"] == 0.1 and mqa.embedding_dropout == 0.2
    assert kw["attention_dropout"] == 0.3 and kw["ffn_hidden_size"] == 256 and kw["normalization"] == "LayerNorm"
    assert kw["add_bias_linear"] and kw["add_qkv_bias"] and not kw["gated_linear_unit"] and mqa.tied
    assert kw["activation_func"] is gelu_tanh and kw["layernorm_epsilon"] == 1e-5
    shapes = mqa.expected_hf_shapes()
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (96, 64) and "lm_head.weight" not in shapes
    assert shapes["transformer.h.0.mlp.c_fc.weight"] == (256, 64) and shapes["transformer.wpe.weight"] == (128, 64)
    assert mqa.position_embedding_type == "learned_absolute"
    mha = get_bridge(_config("gpt_bigcode", multi_query=False))  # NOTE: num_key_value_heads stays 1 (set at init)
    assert mha.transformer_config_kwargs()["num_query_groups"] == 4
    assert mha.expected_hf_shapes()["transformer.h.0.attn.c_attn.weight"] == (192, 64)
    assert "lm_head.weight" in get_bridge(_config("gpt_bigcode_mha")).expected_hf_shapes()
    flags = dict(attention_softmax_in_fp32=False, scale_attention_softmax_in_fp32=False)
    assert get_bridge(_config("gpt_bigcode", **flags)).transformer_config_kwargs() == \
        get_bridge(_config("gpt_bigcode")).transformer_config_kwargs()
    torch.manual_seed(0)
    ref = transformers.GPTBigCodeForCausalLM(_config("gpt_bigcode")).eval()
    off = transformers.GPTBigCodeForCausalLM(_config("gpt_bigcode", **flags)).eval()
    off.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 203, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, off(ids).logits)
    ParallelConfig(tensor_parallel_size=2).check_model(num_layers=4, num_attention_heads=4,
                                                       num_key_value_heads=kv_heads_of(_config("gpt_bigcode")))
    check_kv_replication(mqa, ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(TypeError, match=rf"token_type_ids are not supported for {name}"):
        LoongModelForCausalLM.forward(types.SimpleNamespace(bridge=mqa), torch.zeros(1, 3, dtype=torch.long),
                                      token_type_ids=torch.zeros(1, 3, dtype=torch.long))


def test_llama4_fields_megatron_cannot_express_refused():
    """Llama 4 with top-2 routing (megatron renormalises sigmoid top-k scores and scales the experts' input at top-1
    only), ``attention_bias``, an unknown layer type, chunked layers without a chunk size, a rope type other than
    default / llama3, or ``no_rope_layers`` shorter than the layers: refused by the bridge's pure check, naming the
    field; the hub's settings are taken. Chunked attention is refused by the static KV cache's fixed step and the
    CP-sharded cache's attention (ValueError naming it)."""
    import torch

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.bridges.llama4 import L2Norm
    from loongforge_hf.kernels.attention import attention_chunks, masked_attention, partial_attention
    from loongforge_hf.testing.tiny_models import _config

    name = "Llama4ForCausalLM"
    for field, value, match in (
            ("num_experts_per_tok", 2, r"num_experts_per_tok=2 is not supported for Llama4ForCausalLM \(only 1\)"),
            ("attention_bias", True, r"attention_bias=True is not supported for Llama4ForCausalLM"),
            ("layer_types", ["sliding_attention"] * 4, r"layer_types \['sliding_attention'\] are not supported"),
            ("attention_chunk_size", None, r"attention_chunk_size=None with chunked_attention"),
            ("no_rope_layers", [1, 1], r"no_rope_layers has 2 entries for 4 layers"),
            ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                 "original_max_position_embeddings": 32}, r"rope_type='yarn' is not implemented")):
        with pytest.raises(UnsupportedConfigError, match=match):
            get_bridge(_config("llama4", **{field: value}, architectures=[name]))
    bridge = get_bridge(_config("llama4", architectures=[name]))
    kw = bridge.transformer_config_kwargs()
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_apply_probs_on_input"] and kw["rotary_interleaved"]
    assert kw["moe_layer_freq"] == [0, 1, 0, 1] and kw["ffn_hidden_size"] == 96 and kw["moe_ffn_hidden_size"] == 32
    assert kw["moe_shared_expert_intermediate_size"] == 32 and not kw["moe_shared_expert_gate"]
    assert bridge.qk_module() is L2Norm
    assert bridge.expected_hf_shapes()["model.layers.1.feed_forward.experts.gate_up_proj"] == (4, 64, 64)
    q = torch.zeros(1, 2, 1, 4)
    with attention_chunks(5), pytest.raises(ValueError, match=r"chunked attention .* static KV cache"):
        masked_attention(q, q, q, allowed=torch.ones(1, 1, 1, 1, dtype=torch.bool), scale=1.0)
    with attention_chunks(5), pytest.raises(ValueError, match=r"chunked attention .* context-parallel ranks"):
        partial_attention(q, q, q, allowed=torch.ones(1, 1, 1, 1, dtype=torch.bool), scale=1.0)


def test_qwen3_5_fields_and_layouts_megatron_cannot_express_refused():
    """Qwen3.5 with an unknown layer type, layer types not one per layer, value heads that do not group over the key
    heads, another activation, ``attention_bias``; linear heads that do not split over TP (the layout check, which
    lets context parallelism through); a static-cache generate: each refused naming the field (pure, before any
    collective)."""
    from types import SimpleNamespace

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    for field, value, match in (
            ("layer_types", ["sliding_attention"] * 4, r"layer_types \['sliding_attention'\] are not supported for "
                                                       r"Qwen3_5ForCausalLM"),
            ("layer_types", ["full_attention"] * 3, r"layer_types has 3 entries for 4 layers"),
            ("linear_num_value_heads", 3, r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
            ("hidden_act", "gelu", r"hidden_act='gelu' is not supported for Qwen3_5ForCausalLM"),
            ("attention_bias", True, r"attention_bias=True is not supported for Qwen3_5ForCausalLM")):
        with pytest.raises(UnsupportedConfigError, match=match):
            get_bridge(_config("qwen3_5", **{field: value}))
    bridge = get_bridge(_config("qwen3_5"))
    kw = bridge.transformer_config_kwargs()
    assert kw["attention_output_gate"] and kw["layernorm_zero_centered_gamma"] and kw["qk_layernorm"]
    assert bridge.rope_parameters()["partial_rotary_factor"] == 0.25
    bridge.check_layout(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=True,
                                       context_parallel_size=2))  # NOTE: CP runs (parallel/delta_rule_cp.py)
    odd = get_bridge(_config("qwen3_5", linear_num_key_heads=1, linear_num_value_heads=3))
    with pytest.raises(UnsupportedConfigError, match=r"linear_num_key_heads=1 does not split over "
                                                     r"tensor_parallel_size=2"):
        odd.check_layout(ParallelConfig(tensor_parallel_size=2))
    assert "cache_implementation='static' is not supported for Qwen3_5ForCausalLM" in bridge.generation_refusal(
        SimpleNamespace(use_cache=True, cache_implementation="static"))
    for use_cache, implementation in ((True, None), (True, "dynamic"), (False, "static")):
        assert bridge.generation_refusal(SimpleNamespace(use_cache=use_cache,
                                                         cache_implementation=implementation)) is None


def test_kimi_linear_fields_and_layouts_megatron_cannot_express_refused():
    """Kimi Linear with an unknown or missing layer / MLP type, KV heads other than the heads (transformers' MLA
    repeats its per-head keys by their ratio), another activation, ``attention_bias``, sigmoid scores renormalised
    otherwise than megatron (``norm_topk_prob`` off at top-k > 1, on at top-1); linear heads that do not split
    over TP (context parallelism runs); a static-cache generate: each refused naming the field (pure, before any
    collective). The LM head stays untied whatever ``tie_word_embeddings`` says, as transformers' model."""
    from types import SimpleNamespace

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    for field, value, match in (
            ("layer_types", ["sliding_attention"] * 4, r"layer_types=\['sliding_attention'.*KimiLinearForCausalLM"),
            ("mlp_layer_types", ["dense"] * 3, r"mlp_layer_types=\['dense', 'dense', 'dense'\] is not supported"),
            ("num_key_value_heads", 2, r"num_key_value_heads=2 is not supported for KimiLinearForCausalLM"),
            ("hidden_act", "gelu", r"hidden_act='gelu' is not supported for KimiLinearForCausalLM"),
            ("attention_bias", True, r"attention_bias=True is not supported for KimiLinearForCausalLM")):
        with pytest.raises(UnsupportedConfigError, match=match):
            get_bridge(_config("kimi_linear", **{field: value}))
    for overrides in ({"norm_topk_prob": False}, {"num_experts_per_tok": 1}):  # NOTE: the tiny config's top 2, renormed
        with pytest.raises(UnsupportedConfigError, match=r"norm_topk_prob=(False|True) with num_experts_per_tok=[12] "
                                                         r"is not supported with sigmoid routing"):
            get_bridge(_config("kimi_linear", **overrides)).transformer_config_kwargs()
    bridge = get_bridge(_config("kimi_linear"))
    assert not get_bridge(_config("kimi_linear", tie_word_embeddings=True)).tied  # NOTE: transformers ties nothing
    bridge.check_layout(ParallelConfig(tensor_parallel_size=2, sequence_parallel=True, context_parallel_size=2))
    with pytest.raises(UnsupportedConfigError, match=r"linear_num_heads=4 does not split over tensor_parallel_size=8"):
        bridge.check_layout(ParallelConfig(tensor_parallel_size=8, sequence_parallel=True))
    assert "cache_implementation='static' is not supported for KimiLinearForCausalLM" in bridge.generation_refusal(
        SimpleNamespace(use_cache=True, cache_implementation="static"))


@pytest.mark.parametrize("arch,name", [("qwen3_next", "Qwen3NextForCausalLM"),
                                       ("qwen3_5_moe", "Qwen3_5MoeForCausalLM")])
def test_qwen3_5_moe_and_qwen3_next_refusals_and_declarations(arch, name):
    """Qwen3-Next and Qwen3.5-MoE (Qwen3.5's layers with experts): Qwen3.5's refusals (an unknown layer type, value
    heads that do not group over the key heads, another activation, no experts; linear heads that do not split over
    TP, the layout check, which lets context parallelism through) naming the model, pure, before any collective; the
    MoE layout megatron gets (sparse layers, the gated shared expert, top-k renormalisation) and the checkpoint's
    in-projections."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    for field, value, match in (
            ("layer_types", ["sliding_attention"] * 4, rf"layer_types \['sliding_attention'\] are not supported for "
                                                       rf"{name}"),
            ("linear_num_value_heads", 3, r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
            ("hidden_act", "gelu", rf"hidden_act='gelu' is not supported for {name}"),
            ("num_experts", 0, rf"num_experts=0 is not supported for {name}")):
        with pytest.raises(UnsupportedConfigError, match=match):
            get_bridge(_config(arch, **{field: value}))
    bridge = get_bridge(_config(arch))
    bridge.check_layout(ParallelConfig(context_parallel_size=2, expert_parallel_size=2))  # NOTE: CP runs
    odd = get_bridge(_config(arch, linear_num_key_heads=1, linear_num_value_heads=3))
    with pytest.raises(UnsupportedConfigError, match=r"linear_num_key_heads=1 does not split over "
                                                     r"tensor_parallel_size=2"):
        odd.check_layout(ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2))
    kw = bridge.transformer_config_kwargs()
    assert kw["attention_output_gate"] and kw["layernorm_zero_centered_gamma"] and kw["qk_layernorm"]
    assert kw["moe_layer_freq"] == ([0, 1, 1, 1] if arch == "qwen3_next" else [1] * 4)
    assert kw["moe_shared_expert_gate"] and kw["moe_shared_expert_intermediate_size"] == 48
    assert kw["num_moe_experts"] == 4 and kw["moe_ffn_hidden_size"] == 32 and not kw["moe_router_pre_softmax"]
    shapes = bridge.expected_hf_shapes()
    fused = {"model.layers.0.linear_attn.in_proj_qkvz.weight": (2 * (8 + 8 + 2 * 12 + 2 * 12), 64),
             "model.layers.0.linear_attn.in_proj_ba.weight": (8, 64)}
    split = {"model.layers.0.linear_attn.in_proj_qkv.weight": (2 * 8 + 2 * 8 + 4 * 12, 64),
             "model.layers.0.linear_attn.in_proj_z.weight": (48, 64)}
    for tensor, shape in (fused if arch == "qwen3_next" else split).items():
        assert shapes[tensor] == shape, tensor
    assert not set(split if arch == "qwen3_next" else fused) & set(shapes)
    if arch == "qwen3_next":  # NOTE: Qwen3-MoE's choice of sparse layers and renormalisation
        sparse2 = get_bridge(_config(arch, mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False))
        kw = sparse2.transformer_config_kwargs()
        assert kw["moe_layer_freq"] == [0, 1, 0, 1] and kw["moe_router_pre_softmax"]
