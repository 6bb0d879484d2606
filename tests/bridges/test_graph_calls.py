"""Which calls of a model built with megatron's local CUDA graphs reach megatron's graph manager
(``bridges/builder._graphs_in_training_only``): the training step's forward (train mode, grad on, or a recomputed
layer's first pass) does; evaluation (eval mode), ``generate`` and any other call without grad run the layers
eagerly. Without that, megatron-core 0.16 sends every call to its manager once a graph exists, which fails at another
shape than the training step's and at the same shape replays a training graph that holds none of a KV cache's work.

On the CPU no graph can be captured: each decoder layer gets a stand-in manager that records the call and runs the
layer eagerly, and the outputs are compared with the same model without the stand-ins."""

import torch

from loongforge_hf.parallel.spawn import run_distributed


def _world(folder: str) -> dict:
    from megatron.core.tensor_parallel import random as megatron_random

    import loongforge_hf as lf
    from loongforge_hf.bridges.builder import _graphs_in_training_only

    calls = []

    class Recorder(torch.nn.Module):
        def forward(self, module, args, kwargs):
            calls.append(module.layer_number)
            return torch.nn.Module.__call__(module, *args, **kwargs)

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits = model(input_ids=ids).logits
    want_tokens = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    layers = list(model.chunks[0].decoder.layers)
    for layer in layers:
        layer.cudagraph_manager = Recorder()
    for chunk in model.chunks:
        _graphs_in_training_only(chunk)
        _graphs_in_training_only(chunk)  # NOTE: a second pass leaves the first one's switch alone

    out = {"layers": len(layers)}
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    out["train_step"] = len(calls)
    calls.clear()
    model.eval()
    with torch.enable_grad():
        logits = model(input_ids=ids).logits
    out["eval_mode"] = len(calls)
    out["eval_logits_equal"] = torch.equal(logits.detach(), want_logits)
    model.train()
    with torch.no_grad():
        out["train_mode_no_grad_logits_equal"] = torch.equal(model(input_ids=ids).logits, want_logits)
    out["train_mode_no_grad"] = len(calls)
    # NOTE: generate right after training, the model still in train mode (transformers' generate runs without grad)
    out["generate_tokens_equal"] = torch.equal(model.generate(input_ids=ids, max_new_tokens=4, do_sample=False),
                                               want_tokens)
    out["generate"] = len(calls)
    checkpointing = megatron_random.is_checkpointing
    megatron_random.is_checkpointing = lambda: True
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        megatron_random.is_checkpointing = checkpointing
    out["recompute_first_pass"] = len(calls)
    return out


def test_only_the_training_step_reaches_the_graph_manager(tmp_path):
    from loongforge_hf.testing import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    [got] = run_distributed(_world, 1, str(folder), timeout=300)
    n = got["layers"]
    assert n >= 2 and got["train_step"] == n, got
    assert got["eval_mode"] == 0 and got["eval_logits_equal"], got
    assert got["train_mode_no_grad"] == 0 and got["train_mode_no_grad_logits_equal"], got
    assert got["generate"] == 0 and got["generate_tokens_equal"], got
    assert got["recompute_first_pass"] == n, got
