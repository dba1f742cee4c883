"""The preference-tuning section (`dpo`): which pairwise loss train.objective dpo minimises, with TRL's names."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainyard.config.section import Section

REFERENCE_FREE = frozenset({"simpo", "orpo"})
"""Losses that need no reference model: they run with full fine-tuning too."""


class DpoConfig(Section):
    beta: float = Field(0.1, gt=0)
    """How far the policy may move from the reference (DPO's beta, IPO's tau as 1/beta, SimPO's reward scale); for
    orpo it is the odds-ratio weight lambda, as TRL's ORPOConfig names it `beta`."""
    loss: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"] = "sigmoid"
    """sigmoid (DPO), ipo, hinge and robust (DPO unbiased under label_smoothing's share of flipped pairs) compare
    with the reference: with LoRA the model with its adapters off, with full fine-tuning the initial model's
    log-probabilities, computed once before training (reference.py); simpo (length-normalised, with a margin) and
    orpo (odds ratio plus the chosen sequence's cross-entropy) need none."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """sigmoid (conservative DPO) and robust only: the share of pairs assumed flipped."""
    simpo_gamma: float = 0.5
    """simpo only: the target reward margin gamma, as TRL's CPOConfig names it."""


def objective_problems(objective: str, dpo: DpoConfig, data: object) -> list[tuple[str, str]]:
    """(field, why) for each setting that does not fit train.objective; JobConfig raises them with where they were
    set. A setting counts where it differs from its default: a run's written config.yaml holds them all."""
    changed = {name for name, spec in DpoConfig.model_fields.items() if getattr(dpo, name) != spec.default}
    if objective == "sft":
        return [(f"dpo.{name}", "is set but train.objective is sft: set train.objective: dpo, or remove the dpo "
                 "section") for name in sorted(changed)]
    problems = []
    if dpo.label_smoothing and dpo.loss not in ("sigmoid", "robust"):
        problems.append(("dpo.label_smoothing", f"applies to dpo.loss sigmoid and robust only, not {dpo.loss}: "
                         "remove it"))
    if "simpo_gamma" in changed and dpo.loss != "simpo":
        problems.append(("dpo.simpo_gamma", f"applies to dpo.loss simpo only, not {dpo.loss}: remove it"))
    if getattr(data, "mixture", None):
        problems.append(("data.mixture", "is a pretraining stream; train.objective dpo reads prompt/chosen/rejected "
                         "pairs from data.path"))
    if getattr(data, "packing", False):
        problems.append(("data.packing", "is on, but a preference pair already travels as one row of two documents "
                         "(padding-free): remove data.packing"))
    if getattr(data, "train_on_prompt", False):
        problems.append(("data.train_on_prompt", "is on, but DPO compares the completions only: remove it"))
    return problems
