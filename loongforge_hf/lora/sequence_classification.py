"""LoRA on a sequence classifier (``lf.AutoModelForSequenceClassification``) as PEFT's
``PeftModelForSequenceClassification`` applies it (``LoraConfig(task_type="SEQ_CLS")``).

Choices:
- ``task_type="SEQ_CLS"`` only. PEFT then adds ``"classifier"`` and ``"score"`` to ``modules_to_save`` (the user's
  list, extended, or that list), so the ``score`` head trains whole beside the adapters and the adapter folder
  carries it (``base_model.model.score.weight``; PEFT's in-memory ``score.modules_to_save.default.weight``); here
  the list is extended on a copy of the config (PEFT extends the caller's). Another task type, or none, is refused:
  PEFT's plain ``PeftModel`` would leave a fresh head frozen and out of the adapter folder.
- Targets are matched on transformers' sequence classifier's module tree (``model.layers.N...``, ``score``), built
  on the meta device (``plan._hf_skeleton``). ``"all-linear"`` leaves the head out as PEFT does for ``SEQ_CLS``
  (``SEQ_CLS_HEAD_NAMES``: the first of ``score`` / ``classifier`` the model has); PEFT's matcher never adapts a
  ``modules_to_save`` module.
- The head is one ``Replicated`` tensor of the last pipeline stage (``sequence_classification.ScoreHead``), trained
  in place as the norms of ``modules_to_save`` are (``model.attach_lora``).
- ``LoongLoraModelForSequenceClassification``: the LoRA model's methods (the adapter folder, ``merged=True``,
  ``merge_and_unload`` / ``unload`` back to a ``LoongModelForSequenceClassification``) over the classifier's forward.
"""

from __future__ import annotations

import copy

from loongforge_hf.lora.model import LoongLoraModelForCausalLM
from loongforge_hf.lora.plan import LoraConfigError
from loongforge_hf.sequence_classification import LoongModelForSequenceClassification, SequenceClassificationBridge

CLASSIFIER_MODULES = ("classifier", "score")  # NOTE: PeftModelForSequenceClassification's, in its order


class LoongLoraModelForSequenceClassification(LoongLoraModelForCausalLM, LoongModelForSequenceClassification):
    """A ``LoongModelForSequenceClassification`` with LoRA adapters (made by ``get_peft_model``)."""


def is_classifier(bridge) -> bool:
    return isinstance(bridge, SequenceClassificationBridge)


def classifier_config(config):
    """A copy of the ``LoraConfig`` with PEFT's ``modules_to_save`` for ``SEQ_CLS``; ``LoraConfigError`` for another
    task type (pure: every rank alike)."""
    task = getattr(config, "task_type", None)
    if str(getattr(task, "value", task)) != "SEQ_CLS":
        raise LoraConfigError(f"LoraConfig(task_type={task!r}) on a sequence classifier: use task_type='SEQ_CLS' "
                              "(PEFT's PeftModelForSequenceClassification: the score head trains whole and is saved "
                              "with the adapter).")
    config = copy.copy(config)
    config.modules_to_save = [*(config.modules_to_save or []), *CLASSIFIER_MODULES]
    return config


def classifier_head(skeleton):
    """The head ``"all-linear"`` leaves out (PEFT's ``_maybe_include_all_linear_layers`` for ``SEQ_CLS``)."""
    from peft.utils.constants import SEQ_CLS_HEAD_NAMES

    return next((getattr(skeleton, n) for n in SEQ_CLS_HEAD_NAMES if getattr(skeleton, n, None) is not None), None)
