"""transformers' embedding API on a loongforge model. ``enable_input_require_grads()`` /
``disable_input_require_grads()``: with every parameter but the last layer's frozen, the first decoder layer's input
requires grad only while enabled (and while recomputation asks for it too, whichever is switched off first), and the
gradients of the trainable parameters are the same either way (the extra input gradient changes none of them).
``resize_token_embeddings``: tests/bridges/test_vocab_resize.py."""

import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint


def _world(folder: str) -> dict:
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    last = len(model.chunks[0].decoder.layers) - 1
    for name, p in model.named_parameters():
        p.requires_grad_(f"decoder.layers.{last}." in name)
    seen = []
    model.chunks[0].decoder.layers[0].register_forward_pre_hook(
        lambda m, a, k: seen.append(k["hidden_states"].requires_grad), with_kwargs=True)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = step()
    model.enable_input_require_grads()
    enabled = step()
    with torch.no_grad():
        model(input_ids=ids)  # NOTE: no grad mode: nothing to require
    model.activation_checkpointing_enable()
    model.disable_input_require_grads()
    step()  # recomputation still asks for it
    model.activation_checkpointing_disable()
    step()
    return {"seen": seen, "same_grads": plain.keys() == enabled.keys() and len(plain) > 0
            and all(torch.equal(plain[n], enabled[n]) for n in plain)}


def test_input_require_grads_as_transformers(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    [got] = run_distributed(_world, 1, str(folder), timeout=300)
    # plain, enabled, no grad, recompute on (the layer runs twice: forward and its recomputation), all off
    assert got["seen"] == [False, True, False, True, True, False], got
    assert got["same_grads"], got
