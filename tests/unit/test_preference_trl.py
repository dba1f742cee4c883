"""dpo.loss hinge, robust, simpo and orpo, and sigmoid's label smoothing, equal TRL's own computation of them on the
same model and pairs: DPOTrainer's loss for the losses against a reference, CPOTrainer's and ORPOTrainer's batch
loss for the reference-free ones, and CPOTrainer's conservative sigmoid on the same log-ratios. The tokens are
trainyard's; TRL takes them as its collators lay them out (padded, chosen rows then rejected rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import peft

from tests.unit.test_preference_loss import VOCAB, gradients, lora_llama, shift_adapters, tiny_llama
from trainyard.config import DpoConfig
from trainyard.data import IGNORE_INDEX, build_byte_tokenizer, collate
from trainyard.preference.loss import PairLogps, dpo_loss, pair_logps, pair_loss_sum, target_logps

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
PAIRS = 3
CPU = torch.device("cpu")


def pairs() -> list[dict[str, list[int]]]:
    """Pairs sharing their prompt, replies of different lengths: TRL's prompt_ids, chosen_ids, rejected_ids."""
    generator = torch.Generator().manual_seed(3)
    draw = lambda n: torch.randint(1, VOCAB, (n,), generator=generator).tolist()  # noqa: E731
    return [{"prompt_ids": draw(p), "chosen_ids": draw(c), "rejected_ids": draw(r)}
            for p, c, r in ((3, 4, 6), (5, 2, 2), (2, 7, 3))]


def as_rows(examples: list[dict[str, list[int]]]) -> list[dict[str, list[int]]]:
    """The same pairs as trainyard stores them: one row of two documents, the prompt's labels ignored."""
    rows = []
    for e in examples:
        ignored = [IGNORE_INDEX] * len(e["prompt_ids"])
        chosen, rejected = e["prompt_ids"] + e["chosen_ids"], e["prompt_ids"] + e["rejected_ids"]
        rows.append({"input_ids": chosen + rejected, "labels": ignored + e["chosen_ids"] + ignored + e["rejected_ids"],
                     "seq_lens": [len(chosen), len(rejected)]})
    return rows


def ours(model: torch.nn.Module, cfg: DpoConfig) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss_sum, _ = pair_loss_sum(model, collate(as_rows(pairs()), 0), CPU, cfg)
    return loss_sum / PAIRS, gradients(model, loss_sum / PAIRS)


def trainer(kind: str, tmp_path: Path, model: torch.nn.Module, peft_config: Any = None, **settings: Any) -> Any:
    """A TRL trainer of `kind` (DPO, CPO, ORPO) around `model`; its dataset only lets it start."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    config, cls = {"DPO": (trl.DPOConfig, trl.DPOTrainer), "CPO": (CPOConfig, CPOTrainer),
                   "ORPO": (ORPOConfig, ORPOTrainer)}[kind]
    args = config(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, fp16=False, **settings)
    dataset = datasets.Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    return cls(model=model, args=args, processing_class=build_byte_tokenizer(), train_dataset=dataset,
               peft_config=peft_config)


def padded(rows: list[list[int]], value: int) -> torch.Tensor:
    length = max(map(len, rows))
    return torch.tensor([row + [value] * (length - len(row)) for row in rows])


def trl_pairs_batch() -> dict[str, torch.Tensor]:
    """CPOTrainer's and ORPOTrainer's batch: chosen_* and rejected_* sequences, labels on the replies."""
    batch = {}
    for side in ("chosen", "rejected"):
        sequences = [e["prompt_ids"] + e[f"{side}_ids"] for e in pairs()]
        labels = [[IGNORE_INDEX] * len(e["prompt_ids"]) + e[f"{side}_ids"] for e in pairs()]
        batch |= {f"{side}_input_ids": padded(sequences, 0), f"{side}_labels": padded(labels, IGNORE_INDEX),
                  f"{side}_attention_mask": padded([[1] * len(s) for s in sequences], 0)}
    return batch


@pytest.mark.parametrize(("loss", "beta", "smoothing"), [("hinge", 2.0, 0.0), ("robust", 0.5, 0.2)])
def test_losses_against_a_reference_equal_trls_dpo_trainer(
    tmp_path: Path, loss: str, beta: float, smoothing: float
) -> None:
    """The reference is the model with its adapters off on both sides: TRL adds the adapter (a PEFT model handed
    to it would have its adapter copied as the reference), then the adapter moves away from zero."""
    dpo = trainer("DPO", tmp_path, tiny_llama(), loss_type=[loss], beta=beta, label_smoothing=smoothing,
                  max_length=None, peft_config=peft.LoraConfig(r=4, target_modules="all-linear"))
    model = shift_adapters(dpo.model)
    got, got_grads = ours(model, DpoConfig(loss=loss, beta=beta, label_smoothing=smoothing))
    inputs = trl.trainer.dpo_trainer.DataCollatorForPreference(pad_token_id=0)(pairs())
    want = dpo.compute_loss(dpo.model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert want.item() > 0.0
    for ours_grad, trls_grad in zip(got_grads, gradients(model, want), strict=True):
        torch.testing.assert_close(ours_grad, trls_grad, rtol=1e-4, atol=1e-6)


def test_sigmoids_label_smoothing_is_trls_conservative_sigmoid(tmp_path: Path) -> None:
    """TRL's DPOTrainer no longer smooths its sigmoid (its label_smoothing serves robust and exo_pair); its
    CPOTrainer keeps conservative DPO's sigmoid, here given the same log-ratios."""
    model = lora_llama()
    cfg = DpoConfig(loss="sigmoid", beta=0.5, label_smoothing=0.2)
    batch = collate(as_rows(pairs()), 0)
    with torch.no_grad():
        policy = pair_logps(target_logps(model, batch, CPU), batch)
        reference = PairLogps(*(value * 0.9 for value in (policy.chosen, policy.rejected)), policy.chosen_tokens,
                              policy.rejected_tokens)
    got, stats = dpo_loss(cfg, policy, reference)
    cpo = trainer("CPO", tmp_path, model, loss_type="sigmoid", beta=0.5, label_smoothing=0.2, cpo_alpha=0.0)
    want, chosen_rewards, rejected_rewards = cpo.cpo_loss(policy.chosen - reference.chosen,
                                                          policy.rejected - reference.rejected)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stats[:, :2], torch.stack([chosen_rewards, rejected_rewards], dim=1))
    assert not torch.allclose(got, dpo_loss(DpoConfig(loss="sigmoid", beta=0.5), policy, reference)[0])


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_equal_trls_cpo_and_orpo_trainers(tmp_path: Path, loss: str) -> None:
    """SimPO is CPOTrainer's loss_type simpo with cpo_alpha 0 (no NLL term); ORPO's NLL is the chosen sequences'
    cross-entropy, prompt included, over the batch's tokens."""
    model = lora_llama()
    settings = {"beta": 2.0, "simpo_gamma": 0.3} if loss == "simpo" else {"beta": 0.3}
    got, got_grads = ours(model, DpoConfig(loss=loss, **settings))
    if loss == "simpo":
        reference_free = trainer("CPO", tmp_path, model, loss_type="simpo", cpo_alpha=0.0, **settings)
    else:
        reference_free = trainer("ORPO", tmp_path, model, **settings)
    want, metrics = reference_free.get_batch_loss_metrics(reference_free.model, trl_pairs_batch())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert metrics["rewards/margins"] != 0.0
    for ours_grad, trls_grad in zip(got_grads, gradients(model, want), strict=True):
        torch.testing.assert_close(ours_grad, trls_grad, rtol=1e-4, atol=1e-6)
