"""Preference tuning (train.objective dpo) of the tiny model, LoRA and full: the loss and gradient norm of every step
equal TRL's DPOTrainer given the same weights, pairs and order (one process, fp32), and two ranks (DDP, FSDP2) equal
one process. The reference: with LoRA the model with its adapters off under either wrapper; full, the initial
model's log-probabilities computed in one pass before training."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import TINY, assert_ok, events, train_in, trainyard
from tests.world import World
from trainyard import dist, precision
from trainyard.config_file import load_config
from trainyard.model import source as source_room
from trainyard.train.build import build_and_wrap

pytestmark = pytest.mark.dist

STEPS = 3
COMMON = [
    "train.objective=dpo", "train.precision=fp32", "train.schedule=constant",
    "train.warmup_steps=0", "train.lr=1e-2", f"train.max_steps={STEPS}", "log.every_steps=1", "eval.every_steps=0",
    "eval.at_end=false", "checkpoint.at_end=false", "log.tensorboard=false",
]
FIGURES = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
           "logps/rejected")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sums, each with its right answer chosen and a wrong one rejected: replies of different lengths."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    rows = []
    for _ in range(32):
        a, b = rng.randint(1, 500), rng.randint(1, 500)
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + rng.randint(1, 900))})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def conversations(pairs: Path) -> Path:
    """The same pairs as conversations: a user turn, then the assistant's reply."""
    path = pairs.with_name("conversations.jsonl")
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    path.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": row["prompt"]}],
        "chosen": [{"role": "assistant", "content": row["chosen"]}],
        "rejected": [{"role": "assistant", "content": row["rejected"]}],
    }) + "\n" for row in rows))
    return path


def overrides(out: Path, pairs: Path, *more: str) -> list[str]:
    return [f"output_dir={out}", f"data.path={pairs}", *COMMON, *more]


def ours(world: World, out: Path, pairs: Path, *more: str) -> list[dict[str, Any]]:
    train_in(world, TINY, *overrides(out, pairs, *more), env={"TRAINYARD_RECORD_SAMPLES": "1"})
    return events(out / "tiny", "train")


def trls(out: Path, pairs: Path, loss: str, micro_batch: int, *more: str) -> list[dict[str, Any]]:
    """TRL's DPOTrainer on the model trainyard builds (same seed: same weights and LoRA init), taking the rows in
    the order trainyard's run took them (its sample record), with the same AdamW, clipping and constant rate."""
    trl = pytest.importorskip("trl")
    import datasets
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback

    cfg = load_config(TINY, overrides(out, pairs, *more))
    cpu = torch.device("cpu")
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    model, _, _ = build_and_wrap(cfg, dist.DistInfo(0, 1, 0, 1, cpu, None), precision.resolve(cfg, cpu), None,
                                 tokenizer)
    record = (out / "tiny" / "samples" / "rank-0.jsonl").read_text().splitlines()
    order = [index for line in record[1:] for _, _, index in json.loads(line)["rows"]]
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]

    class InOrder(trl.DPOTrainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)

    logged: list[dict[str, Any]] = []

    class Keep(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
            if logs and "loss" in logs:
                logged.append({**logs, "step": state.global_step})

    args = trl.DPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=micro_batch, max_steps=STEPS,
        learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.train.weight_decay,
        max_grad_norm=cfg.train.max_grad_norm, adam_beta1=cfg.train.betas[0], adam_beta2=cfg.train.betas[1],
        beta=cfg.dpo.beta, loss_type=[loss], logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        max_length=None, bf16=False, fp16=False,
    )
    reference = None if cfg.lora.enabled else copy.deepcopy(model).eval()  # TRL's frozen copy of full fine-tuning
    trainer = InOrder(model=model, ref_model=reference, args=args, processing_class=tokenizer, callbacks=[Keep()],
                      train_dataset=datasets.Dataset.from_list([rows[i] for i in order]))
    trainer.train()
    return logged


def assert_same_figures(got: list[dict[str, Any]], want: list[dict[str, Any]], tolerance: float) -> None:
    assert [e["step"] for e in got] == [e["step"] for e in want] == list(range(1, STEPS + 1))
    for name in FIGURES:
        np.testing.assert_allclose([e[name] for e in got], [e[name] for e in want], rtol=tolerance, atol=tolerance,
                                   err_msg=name)


@pytest.mark.parametrize("lora", ["true", "false"], ids=["lora", "full"])
@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_loss_and_gradient_norm_equal_trls_dpo_trainer(
    solo: World, tmp_path: Path, pairs: Path, loss: str, lora: str
) -> None:
    """TRL keeps a frozen copy of the model as the reference of full fine-tuning; trainyard its log-probabilities.
    Full fine-tuning trains the (tied) head: its logits here go 3 tokens at a time, forward and backward."""
    more = (f"dpo.loss={loss}", f"lora.enabled={lora}", "dist.strategy=none", "train.micro_batch_size=4",
            "train.global_batch_size=4", *(() if lora == "true" else ("train.loss_chunk_tokens=3",)))
    got = ours(solo, tmp_path, pairs, *more)
    want = trls(tmp_path, pairs, loss, 4, *more)
    assert got[-1]["rewards/margins"] != 0.0  # the policy moved away from the reference
    assert_same_figures(got, want, 1e-5)


@pytest.fixture(scope="module")
def one_process(solo: World, pairs: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("one")
    return {lora: ours(solo, out / lora, pairs, f"lora.enabled={lora}", "dist.strategy=none",
                       "train.micro_batch_size=8", "train.global_batch_size=8") for lora in ("true", "false")}


@pytest.mark.parametrize(("strategy", "lora"), [("ddp", "true"), ("fsdp", "true"), ("fsdp", "false")],
                         ids=["ddp-lora", "fsdp-lora", "fsdp-full"])
def test_two_ranks_equal_one_process(
    world: World, tmp_path: Path, pairs: Path, one_process: dict[str, list[dict[str, Any]]], strategy: str, lora: str
) -> None:
    """Each rank holds half the step's pairs: the loss is the mean over all 8, figures averaged over them. A
    reference that kept the adapters on would equal the policy: no reward would ever leave 0. Full fine-tuning
    under FSDP2 computes its reference in lockstep, each rank its share of the rows."""
    got = ours(world, tmp_path, pairs, f"lora.enabled={lora}", f"dist.strategy={strategy}",
               "train.micro_batch_size=4", "train.global_batch_size=8")
    assert all(e["pairs"] == 8 for e in got)
    assert all(e["rewards/chosen"] != 0.0 for e in got[1:])
    assert_same_figures(got, one_process[lora], 1e-5)


@pytest.mark.parametrize("lora", ["true", "false"], ids=["lora", "full"])
def test_context_parallelism_equals_one_process(
    world: World, tmp_path: Path, pairs: Path, one_process: dict[str, list[dict[str, Any]]], lora: str
) -> None:
    """dist.context_parallel 2 on 2 ranks, the whole loop: both take the step's 8 pairs, each half of the row's
    tokens; each reply's log-probabilities are summed over the two, each pair counted on one rank (`pairs` is the
    step's 8, not 16). Full fine-tuning's reference pass runs under the CP build, each rank its rows whole. (A reply
    across the halves, and every gradient: tests/dist/test_context_parallel_dpo.py.)"""
    got = ours(world, tmp_path, pairs, f"lora.enabled={lora}", "dist.strategy=fsdp", "dist.context_parallel=2",
               "train.micro_batch_size=8", "train.global_batch_size=8")
    assert all(e["pairs"] == 8 for e in got)
    assert_same_figures(got, one_process[lora], 1e-5)


def test_full_fine_tunings_reference_is_computed_once_and_reused(solo: World, tmp_path: Path, pairs: Path) -> None:
    """A second job on the same model and data (a resume, a rerun) reads the kept log-probabilities: same steps."""
    more = ("lora.enabled=false", "dist.strategy=none", "train.micro_batch_size=4", "train.global_batch_size=4",
            f"data.cache_dir={tmp_path / 'cache'}")
    first = ours(solo, tmp_path / "first", pairs, *more)
    kept = list((tmp_path / "cache").glob("*/reference-*.json"))
    assert len(kept) == 1
    stamp = kept[0].stat().st_mtime_ns
    again = ours(solo, tmp_path / "again", pairs, *more)
    assert "reusing reference log-probabilities" in (tmp_path / "again" / "tiny" / "logs" / "rank-0.log").read_text()
    assert kept[0].stat().st_mtime_ns == stamp
    assert_same_figures(again, first, 0.0)


def test_dpo_from_an_sft_adapter_takes_it_as_policy_and_reference(world: World, tmp_path: Path, pairs: Path) -> None:
    """SFT, then DPO from its adapter (lora.init_from) under FSDP2: the first step's policy is the SFT adapter and
    so is the reference (rewards exactly 0, loss log 2), not the base (a start from the base has other log-probs);
    then the policy moves while the frozen copy stays."""
    sft = tmp_path / "sft"
    train_in(world, TINY, f"output_dir={sft}", "lora.enabled=true", "train.max_steps=4", "train.lr=1e-2",
             "eval.every_steps=0", "eval.at_end=false", "log.tensorboard=false", "dist.strategy=fsdp")
    adapter = sft / "tiny" / "checkpoints" / "step-00000004" / "adapter"
    more = ("lora.enabled=true", "dist.strategy=fsdp", "train.micro_batch_size=4", "train.global_batch_size=8")
    got = ours(world, tmp_path / "dpo", pairs, *more, f"lora.init_from={adapter}")
    from_base = ours(world, tmp_path / "base", pairs, *more)
    assert got[0]["rewards/chosen"] == got[0]["rewards/rejected"] == 0.0
    assert got[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert abs(got[0]["logps/chosen"] - from_base[0]["logps/chosen"]) > 1e-3
    assert all(e["rewards/margins"] != 0.0 for e in got[1:])


def test_eval_of_a_dpo_checkpoint_matches_the_runs_own(solo: World, tmp_path: Path, pairs: Path) -> None:
    """`trainyard eval` of full fine-tuning's DPO: the reference is the initial model's (kept, or computed before
    the checkpoint's weights are loaded), so its figures are the run's final eval's."""
    more = ["lora.enabled=false", "dist.strategy=none", "train.micro_batch_size=4", "train.global_batch_size=4",
            "data.eval_fraction=0.25", "eval.at_end=true", "checkpoint.at_end=true"]
    train_in(solo, TINY, *overrides(tmp_path, pairs, *more))
    result = trainyard("eval", TINY, *overrides(tmp_path, pairs, *more), "--checkpoint", str(tmp_path / "tiny"))
    assert_ok(result)
    got = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    want = events(tmp_path / "tiny", "eval")[-1]
    assert int(got["eval_pairs"]) == want["eval_pairs"] == 8
    for name in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert float(got[name]) == pytest.approx(want[name], rel=1e-6, abs=1e-7), name
    assert want["eval_rewards/margins"] != 0.0


def test_conversational_pairs_equal_trls_dpo_trainer(solo: World, tmp_path: Path, conversations: Path) -> None:
    """Chat pairs: trainyard's SFT masks of the reply (through the template's end of turn) are the tokens TRL
    trains after the rendered prompt, under the byte tokenizer's template."""
    more = ("lora.enabled=true", "dist.strategy=none", "train.micro_batch_size=4", "train.global_batch_size=4")
    assert_same_figures(ours(solo, tmp_path, conversations, *more), trls(tmp_path, conversations, "sigmoid", 4, *more),
                        1e-5)
