"""`model.gradient_checkpointing: selective` trains exactly as no checkpointing does, keeps less than no
checkpointing and more than full checkpointing, and renames nothing; a bad value is a config error."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from torch.utils._pytree import tree_leaves

from tests.conftest import TINY, run_cli
from trainyard.config_file import load_config
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import source as source_room
from trainyard.parallel import checkpointing

MODES: dict[str, bool | str] = {"none": False, "full": True, "selective": "selective"}


class ForwardStorages(TorchDispatchMode):
    """Remembers every storage an op creates, weakly: those still alive after the forward are the activations
    kept for the backward (saved by autograd or by selective checkpointing's cache), whoever holds them.
    saved_tensors_hooks cannot tell full from selective: inside a checkpoint only its own hooks run."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())


def tiny_model(mode: str, lora: bool) -> torch.nn.Module:
    """The tiny preset's Llama in fp32, the same seeded weights for every mode; with LoRA, B is drawn too
    (PEFT starts it at 0, which would leave every A's gradient 0 and compare nothing)."""
    cfg = load_config(TINY, [f"model.gradient_checkpointing={str(MODES[mode]).lower()}"])
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    model = model_room.load_model(cfg.model, None, tokenizer, torch.float32, cfg.train.seed)
    if lora:
        model = lora_room.apply_lora(model, cfg.lora, cfg.train.seed)
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
    if cfg.model.gradient_checkpointing:
        checkpointing.enable_activation_checkpointing(model, selective=cfg.model.gradient_checkpointing == "selective")
    return model.train()


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 250, (4, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def train_step(mode: str, lora: bool) -> tuple[float, dict[str, torch.Tensor], int, list[str]]:
    """Loss, gradients, bytes kept for the backward, state-dict keys."""
    model = tiny_model(mode, lora)
    with ForwardStorages() as storages:
        loss = model(**batch()).loss
    kept = storages.live_bytes()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, kept, list(model.state_dict())


@pytest.fixture(scope="module", params=[False, True], ids=["full-fine-tuning", "lora"])
def steps(request: pytest.FixtureRequest) -> dict[str, tuple[float, dict[str, torch.Tensor], int, list[str]]]:
    return {mode: train_step(mode, request.param) for mode in MODES}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_gives_the_same_loss_and_gradients(steps: dict, mode: str) -> None:
    loss, grads, _, _ = steps[mode]
    want_loss, want_grads, _, _ = steps["none"]
    assert loss == pytest.approx(want_loss, abs=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert grad is not None and want_grads[name].abs().sum() > 0, name
        torch.testing.assert_close(grad, want_grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_selective_keeps_less_than_none_and_more_than_full(steps: dict) -> None:
    kept = {mode: step[2] for mode, step in steps.items()}
    assert kept["full"] < kept["selective"] < kept["none"], kept


def test_checkpointing_renames_no_weight(steps: dict) -> None:
    assert steps["selective"][3] == steps["full"][3] == steps["none"][3]


def test_a_bad_mode_names_the_field_and_the_choices(tmp_path: Path) -> None:
    result = run_cli("train", TINY, f"output_dir={tmp_path}", "model.gradient_checkpointing=sometimes", "--dry-run")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for needle in ["model.gradient_checkpointing", "selective", "'sometimes'"]:
        assert needle in result.stderr, result.stderr[-3000:]


class ExpertOps(TorchDispatchMode):
    """How many times the token exchange and the grouped products run, forward, recompute and backward together."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name
        if name in checkpointing.GROUPED_PRODUCTS | checkpointing.COMMUNICATION_OPS:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def experts_block(rows: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """EP's shape in miniature: rows exchanged, two grouped products, rows exchanged back."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    from trainyard.model.moe_lora import grouped_mm

    group = torch.distributed.group.WORLD
    offsets = torch.tensor([5, rows.size(0)], dtype=torch.int32)
    arrived = all_to_all_single_autograd(rows, [rows.size(0)], [rows.size(0)], group)
    out = grouped_mm(torch.relu(grouped_mm(arrived, up, offsets)), down, offsets)
    return all_to_all_single_autograd(out, [rows.size(0)], [rows.size(0)], group)


def expert_ops_of(checkpointed: bool) -> dict[str, int]:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 16, generator=generator, requires_grad=True)
    up, down = (torch.randn(2, 16, 16, generator=generator, requires_grad=True) for _ in range(2))
    with ExpertOps() as seen:
        if checkpointed:
            context = partial(create_selective_checkpoint_contexts, checkpointing.selective_policy(low_rank=4))
            out = checkpoint(experts_block, rows, up, down, use_reentrant=False, context_fn=context)
        else:
            out = experts_block(rows, up, down)
        out.square().sum().backward()
    return seen.counts


def test_selective_checkpointing_keeps_the_token_exchange_and_the_grouped_products() -> None:
    """Backward under the selective policy runs no all-to-all and no grouped product more than backward without
    checkpointing: their outputs are kept, not recomputed (torchtitan keeps all_to_all_single too)."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        plain, selective = expert_ops_of(False), expert_ops_of(True)
    finally:
        torch.distributed.destroy_process_group()
    assert plain["_c10d_functional::all_to_all_single"] == 4  # two forward, two backward
    assert sum(v for k, v in plain.items() if k in checkpointing.GROUPED_PRODUCTS) >= 2
    assert selective == plain
