"""Assertions on the results of ``_router_aux``'s forward checks (transformers' pairs against ours), shared by the
tests that run them under each layout."""

import pytest


def assert_router_logits(router: dict, *, grad: bool) -> None:
    """Ours as transformers' (3 MoE layers of Qwen3-MoE's 4, Mixtral's 4), within 1e-5; carrying grad as
    transformers' do where ``grad`` (a forward with a graph), detached otherwise (a pipelined forward, no_grad)."""
    want, got = router["layers"]
    assert got == want and want in (3, 4), router
    assert all(a == b for a, b in router["shapes"]) and all(a == b for a, b in router["dtypes"]), router
    assert router["diff"] < 1e-5 and router["size"] > 1e-2, router
    hf_grad, ours_grad = router["requires_grad"]
    assert ours_grad == [grad] * got and (not grad or hf_grad == ours_grad), router


def assert_forward(forward: dict) -> None:
    """``forward_checks``' pairs: loss, aux_loss (1e-5) and router_logits as transformers', the pads counted as
    transformers counts them, coef 0 and the output_router_logits keyword, the routers' gradients (1e-4 of the
    largest entry)."""
    for name in ("no_mask", "mask"):
        assert forward[name]["type"] == "MoeCausalLMOutputWithPast"
        want, got = forward[name]["loss"]
        assert got == pytest.approx(want, rel=1e-5), (name, forward[name])
        want, got = forward[name]["aux"]
        assert got == pytest.approx(want, rel=1e-5), (name, forward[name])
        assert_router_logits(forward[name]["router"], grad=True)
    assert forward["mask"]["aux"][0] != pytest.approx(forward["no_mask"]["aux"][0], rel=1e-4)  # the pads matter
    want, got = forward["no_grad_no_labels"]
    assert got == pytest.approx(want, rel=1e-5)
    assert_router_logits(forward["no_grad_router"], grad=False)
    assert_router_logits(forward["keyword_on"], grad=False)
    for field in ("loss", "aux"):
        want, got = forward["coef0"][field]
        assert got == pytest.approx(want, rel=1e-5), forward["coef0"]
    assert forward["coef0"]["loss"][0] == pytest.approx(forward["mask"]["loss"][0] - 0.1 * forward["mask"]["aux"][0])
    assert_router_logits(forward["coef0"]["router"], grad=True)
    # an objective on the router logits alone gives the routers transformers' gradient
    assert forward["logits_grad_size"] > 1e-4 and forward["logits_grad"] < 1e-4, forward
    assert all(size > 1e-4 for size in forward["grad_size"]) and max(forward["grad"]) < 1e-4, forward
    # a quarter of the loss backpropagated: a quarter of the balancing gradient; loss - coef * aux: none of it
    assert forward["scaled"] < 1e-4 and forward["without_aux"] < 1e-4, forward
    (hf_type, ours_type), (hf_loss, ours_loss), (hf_logits, ours_logits) = forward["keyword_off"]
    assert ours_type == hf_type and ours_loss == pytest.approx(hf_loss, rel=1e-5), forward["keyword_off"]
    assert hf_logits is None and ours_logits is None


def assert_forward_values(forward: dict, *, grad: bool) -> None:
    """``forward_values``' pairs: loss and aux_loss within 1e-5 relative, with and without the pads' mask, and the
    router logits (``grad``: a forward with a graph; a pipelined one runs without)."""
    for name in ("no_mask", "mask"):
        for want, got in forward[name]:
            assert got == pytest.approx(want, rel=1e-5), (name, forward)
        assert_router_logits(forward[name + "_router"], grad=grad)
