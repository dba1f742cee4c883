"""Run under torchrun (2 ranks): build the tiny LoRA job under FSDP2 the way training does (lora_B seeded, so no
adapter tensor is zero), then report what each rank's `adapter_state` holds on its host, and on rank 0 how it and
the file `save_adapter` writes compare with the adapter of the same model built unsharded in one process.

argv: OUT_DIR. Each rank writes OUT_DIR/rank-<r>.json: tensors and bytes `adapter_state` returned, and on rank 0
names_match, max_diff (returned vs unsharded), saved_max_diff (adapter_model.safetensors vs unsharded),
reference_bytes, devices.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from families_fsdp import TINY, build_model  # beside this script
from trainyard import dist
from trainyard.checkpoint.save import adapter_state, save_adapter
from trainyard.config_file import load_config
from trainyard.parallel.parallelize import unwrap

COMMON = ["train.precision=fp32", "lora.enabled=true"]


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[name] - want[name]).abs().max().item() for name in want)


def compare_with_unsharded(state: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> dict:
    """Rank 0 alone: the same job built in one process, unsharded."""
    alone = dist.DistInfo(0, 1, 0, 1, torch.device("cpu"), None)
    reference = {name: t.detach() for name, t in get_peft_model_state_dict(
        unwrap(build_model([*COMMON, "dist.strategy=none"], alone))).items()}
    names_match = sorted(state) == sorted(reference) == sorted(saved)
    return {
        "names_match": names_match,
        "max_diff": max_diff(state, reference) if names_match else None,
        "saved_max_diff": max_diff(saved, reference) if names_match else None,
        "reference_bytes": nbytes(reference),
        "devices": sorted({str(t.device) for t in state.values()}),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    info = dist.init(load_config(TINY, ["dist.timeout_s=120"]).dist)
    assert info.world_size == 2, info
    model = build_model([*COMMON, "dist.strategy=fsdp"], info)
    state = adapter_state(model, info)
    save_adapter(model, out_dir / "adapter", info)
    report = {"tensors": len(state), "bytes": nbytes(state)}
    if info.is_main:
        report |= compare_with_unsharded(state, load_file(str(out_dir / "adapter" / "adapter_model.safetensors")))
    (out_dir / f"rank-{info.rank}.json").write_text(json.dumps(report))
    dist.exit_process(0)


if __name__ == "__main__":
    main()
