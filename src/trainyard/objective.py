"""What a step minimises, chosen once per job (train.objective): the loss sum of a micro-batch and the count it is
normalised by over the step's global batch (target tokens for SFT, pairs for DPO). The loop stays the same for
both; DPO's figures (TRL's rewards/ and logps/) ride the log window's one all-gather and eval's one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from trainyard.config import DpoConfig
from trainyard.config.preference import REFERENCE_FREE
from trainyard.data import IGNORE_INDEX
from trainyard.data.preference import check_objective_fits
from trainyard.loss import token_loss_sum
from trainyard.model.collation import check_pair_rows
from trainyard.parallel.parallelize import unwrap
from trainyard.preference.loss import STATS, count_pairs, pair_loss_sum
from trainyard.preference.reference import attach_reference


@dataclass
class PairFigures:
    """DPO's figures summed over pairs: the step being trained (`pending`), then the log window's (`window`). A step
    skipped for a non-finite loss is dropped, as the window drops its loss."""

    device: torch.device
    pending: torch.Tensor = field(init=False)
    window: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.pending = torch.zeros(len(STATS) + 1, dtype=torch.float64, device=self.device)  # pairs, then STATS
        self.window = torch.zeros_like(self.pending)

    def add(self, pairs: int, stats: torch.Tensor) -> None:
        self.pending[0] += pairs
        self.pending[1:] += stats.detach().double()

    def commit(self) -> None:
        self.window += self.pending
        self.pending.zero_()

    def drop(self) -> None:
        self.pending.zero_()

    def reset(self) -> None:
        self.window.zero_()

    def row(self) -> torch.Tensor:
        return self.window

    @staticmethod
    def figures(summed: torch.Tensor, prefix: str = "") -> dict[str, float]:
        """Each figure averaged over the pairs `summed` (a row, or rows added up) counted."""
        pairs = max(float(summed[0]), 1.0)
        return {f"{prefix}{name}": float(value) / pairs for name, value in zip(STATS, summed[1:].tolist())}


class Sft:
    """Cross-entropy summed over target tokens, normalised by the target tokens."""

    name = "sft"
    figures: PairFigures | None = None

    def __init__(self, chunk_tokens: int | None = None) -> None:
        self.chunk_tokens = chunk_tokens

    @staticmethod
    def count(batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        return token_loss_sum(model, batch, device, self.chunk_tokens)[0]


class Dpo:
    """A preference loss summed over pairs, normalised by the pairs: the mean over the global batch's pairs."""

    name = "dpo"

    def __init__(self, cfg: DpoConfig, device: torch.device, chunk_tokens: int | None = None) -> None:
        self.cfg = cfg
        self.chunk_tokens = chunk_tokens
        self.figures: PairFigures | None = PairFigures(device)

    @staticmethod
    def count(batch: dict[str, torch.Tensor]) -> int:
        return count_pairs(batch)

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        loss, stats = pair_loss_sum(model, batch, device, self.cfg, self.chunk_tokens)
        if self.figures is not None:
            self.figures.add(self.count(batch), stats)
        return loss


Objective = Sft | Dpo


def build_objective(job: Any, log: Callable[[str], None]) -> Objective:
    """The job's objective, once its data is prepared and its model built with its initial weights (before a
    resume loads its own): DPO needs pairs, SFT rows that are not pairs. Full fine-tuning's DPO against a reference
    reads the initial model's log-probabilities of every pair (computed now, or kept from an earlier job)."""
    cfg, data = job.cfg, job.data
    pairs = data.train is not None and "seq_lens" in data.train.column_names and not cfg.data.packing
    check_objective_fits(cfg.train.objective, pairs, cfg.data.path)
    if cfg.train.objective == "sft":
        return Sft(cfg.train.loss_chunk_tokens)
    check_pair_rows(unwrap(job.model))
    if not cfg.lora.enabled and cfg.dpo.loss not in REFERENCE_FREE:
        attach_reference(cfg, data, job.model, job.info, job.precision, job.autocast, log)
    return Dpo(cfg.dpo, job.info.device, cfg.train.loss_chunk_tokens)
