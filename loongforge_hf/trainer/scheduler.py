"""transformers' LR schedulers driving megatron's inner torch optimizer(s) together."""

from __future__ import annotations


class LinkedSchedulers:
    """One transformers scheduler per inner optimizer (megatron chains one per parameter family), stepped together."""

    def __init__(self, schedulers: list) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        for s, sd in zip(self.schedulers, state["schedulers"]):
            s.load_state_dict(sd)
