"""`model.gradient_checkpointing: selective` trains exactly as no checkpointing does, keeps less than no
checkpointing and more than full checkpointing, and renames nothing; a bad value is a config error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
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
