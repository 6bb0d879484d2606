"""Helpers for tests, the demo and benchmarks: tiny HF checkpoints written by transformers itself."""

from loongforge_hf.testing.tiny_models import TINY_ARCHS, make_tiny_checkpoint, make_tiny_tokenizer

__all__ = ["TINY_ARCHS", "make_tiny_checkpoint", "make_tiny_tokenizer"]
