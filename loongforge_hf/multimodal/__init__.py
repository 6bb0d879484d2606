"""Vision-language models: a vision tower beside a megatron-core language model, each with its own parallel layout."""
