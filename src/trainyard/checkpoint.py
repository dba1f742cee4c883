"""Checkpoints: lite (the LoRA adapter only, PEFT format).

Seed 000's LoRA checkpoint called the wrapped model's state_dict() and so all-gathered
the whole 108B base until NCCL timed out. A lite checkpoint here touches only the adapter
tensors: under FSDP2 each of those few DTensors is gathered, the frozen base never is.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from trainyard.dist import DistInfo, barrier
from trainyard.parallel import unwrap


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors on CPU, full size; a collective per DTensor, nothing else."""
    peft_model = unwrap(model)
    state = get_peft_model_state_dict(peft_model)
    full = {}
    for name, tensor in state.items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        full[name] = tensor.detach().to("cpu").contiguous()
    return full


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_adapter(model: torch.nn.Module, out_dir: Path, info: DistInfo) -> Path | None:
    """Write adapter_model.safetensors + adapter_config.json that PeftModel.from_pretrained loads."""
    peft_model = unwrap(model)
    if not isinstance(peft_model, PeftModel):
        return None
    state = adapter_state(model)
    if info.is_main:
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        peft_model.peft_config["default"].save_pretrained(str(tmp))
        _fsync_dir(tmp)
        if out_dir.exists():
            for stale in out_dir.iterdir():
                stale.unlink()
            out_dir.rmdir()
        tmp.rename(out_dir)
    barrier()
    return out_dir
