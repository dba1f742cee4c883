"""Run under torchrun (2 ranks, or more): for each MoE family, with LoRA and with full fine-tuning, build the job the
way training does (`build.build_and_wrap`, dist.strategy fsdp, dist.expert_parallel 2 by default, fp32), run one
forward and backward with a different micro-batch on each rank (collated as the trainer collates it for the family:
one padding-free row, or padded rows: collation.model_one_row), and compare the mean of the ranks'
losses and every trainable parameter's gradient (the EP ranks' experts put back together) with a 1-process build on
rank 0 that takes every rank's micro-batch's mean loss.

argv: result file, a JSON object {job: {"settings": HF config settings (model_type included), "idle": expert or
null, "parallel": the dist overrides (default: dist.strategy=fsdp dist.expert_parallel=2)}}. `idle`: that expert's score
correction bias is set far below the others' (glm4_moe, deepseek_v3), so no token anywhere chooses it. Rank 0 writes
one JSON line per (job, lora): job, lora, loss_rel, grad_rel, grad_abs (max abs difference), worst, trainable,
expert_rows (per expert stack: the experts a rank holds, the size of the mesh FSDP shards them over), idle_zero (the
idle expert's gradients are all zero in both builds, or null), ok_error. A failure is caught per job.
"""

from __future__ import annotations

import json
import sys
import traceback
import zlib
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from trainyard import dist, precision
from trainyard.config.data import DataConfig
from trainyard.config_file import load_config
from trainyard.data.collate import collate
from trainyard.data.formats import IGNORE_INDEX
from trainyard.model import collation
from trainyard.model import attention, documents
from trainyard.model import source as source_room
from trainyard.parallel import expert_parallel, parallelize
from trainyard.train import build

TINY = str(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml")
DOCUMENTS = (20, 13, 27)
WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "module"})
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def batch(seed: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The documents collated as the trainer collates them for `model`: one padding-free row, or padded rows where
    its layers would carry a state from one document into the next (collation.padded_rows)."""
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in DOCUMENTS]
    inner = parallelize.unwrap(model)
    rows = [{"input_ids": d, "labels": [IGNORE_INDEX, *d[1:]]} for d in docs]
    one_row = collation.model_one_row(inner, DataConfig(path="x.jsonl"))
    return collate(rows, inner.config.pad_token_id, padding_free=one_row)


def loss_of(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean loss of the micro-batch, given to the model as the trainer gives it (documents.model_inputs)."""
    inputs = documents.model_inputs(rows, torch.device("cpu"), parallelize.unwrap(model).config)
    logits = model(**inputs, use_cache=False).logits
    targets = rows["labels"][:, 1:]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def key(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def experts_of(settings: dict) -> int:
    return next(settings[k] for k in EXPERT_KEYS if k in settings)


def own_expert_columns(full: torch.Tensor, experts: int, ep_rank: int, ep_size: int) -> torch.Tensor:
    """lora_B [out, r x experts], expert innermost: this EP rank's experts' columns."""
    local = experts // ep_size
    picked = full.reshape(full.shape[0], -1, experts)[:, :, ep_rank * local : (ep_rank + 1) * local]
    return picked.reshape(full.shape[0], -1)


def perturb_adapters(model: torch.nn.Module, experts: int, apart: set[int], ep_rank: int, ep_size: int) -> None:
    """Every lora_B the same seeded values by name in both builds (an EP rank's expert adapters: its experts')."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" not in name:
                continue
            generator = torch.Generator().manual_seed(zlib.crc32(key(name).encode()))
            shape = list(param.shape)
            if id(param) in apart:
                shape[1] = shape[1] * ep_size
            full = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(0.05)
            if id(param) in apart:
                full = own_expert_columns(full, experts, ep_rank, ep_size)
            if isinstance(param, DTensor):
                param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
            else:
                param.copy_(full)


def make_idle(model: torch.nn.Module, idle: int | None) -> None:
    if idle is None:
        return
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer[idle] = -1e4


def build_model(overrides: list[str], info: dist.DistInfo, settings: dict, idle: int | None) -> torch.nn.Module:
    cfg = load_config(TINY, overrides)
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    model, _, mesh = build.build_and_wrap(cfg, info, precision.resolve(cfg, info.device), None, tokenizer)
    groups = expert_parallel.expert_parallel_groups(model)
    group = next(iter(groups.values()), None)
    apart = set(groups)
    ep_rank, ep_size = (torch_dist.get_rank(group), torch_dist.get_world_size(group)) if apart else (0, 1)
    if cfg.lora.enabled:
        perturb_adapters(model, experts_of(settings), apart, ep_rank, ep_size)
    make_idle(model, idle)
    return model


def whole_expert_grad(name: str, grad: torch.Tensor, experts: int, group: torch_dist.ProcessGroup) -> torch.Tensor:
    """An EP gradient put back together from the EP group's experts."""
    parts = [torch.zeros_like(grad) for _ in range(torch_dist.get_world_size(group))]
    torch_dist.all_gather(parts, grad.contiguous(), group=group)
    if "lora_B" in name:
        out = grad.shape[0]
        return torch.cat([p.reshape(out, -1, experts // len(parts)) for p in parts], dim=2).reshape(out, -1)
    return torch.cat(parts, dim=0)


def full_grads(model: torch.nn.Module, experts: int) -> dict[str, torch.Tensor | None]:
    apart = expert_parallel.expert_parallel_groups(model)
    grads: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        if grad is not None and id(param) in apart:
            grad = whole_expert_grad(name, grad, experts, apart[id(param)])
        grads[key(name)] = None if grad is None else grad.detach().float().clone()
    return grads


def expert_rows(model: torch.nn.Module) -> list[list[int]]:
    """Per expert stack: the experts of this EP rank, and the size of the mesh FSDP shards them over."""
    apart = expert_parallel.expert_parallel_groups(model)
    return [[param.shape[0], param.device_mesh.size()] for param in model.parameters()
            if id(param) in apart and param.dim() == 3 and isinstance(param, DTensor)]


def idle_rows_zero(grads: dict[str, torch.Tensor | None], idle: int, experts: int) -> bool:
    """Every gradient row of the idle expert is exactly zero (stacks: row idle; lora_A: its r rows; lora_B: its
    columns); and the test has such gradients to look at."""
    looked = 0
    for name, grad in grads.items():
        if ".experts." not in name or grad is None:
            continue
        if "lora_B" in name:
            part = grad.reshape(grad.shape[0], -1, experts)[:, :, idle]
        elif "lora_A" in name:
            part = grad.reshape(experts, -1, grad.shape[-1])[idle]
        else:
            part = grad[idle]
        looked += 1
        if part.abs().max().item() != 0.0:
            return False
    return looked > 0


def compare(settings: dict, idle: int | None, lora: bool, info: dist.DistInfo, parallel: list[str]) -> dict:
    experts = experts_of(settings)
    common = [f"model.config={json.dumps(settings)}", "model.tokenizer=builtin:bytes", "train.precision=fp32",
              f"lora.enabled={str(lora).lower()}", "model.attn_implementation=auto"]
    sharded = build_model([*common, *parallel], info, settings, idle)
    rows_held = expert_rows(sharded)
    loss = loss_of(sharded, batch(1 + info.rank, sharded))
    loss.backward()
    losses = [torch.zeros(()) for _ in range(info.world_size)]
    torch_dist.all_gather(losses, loss.detach())
    grads = full_grads(sharded, experts)
    del sharded
    if not info.is_main:
        return {}
    alone = dist.DistInfo(0, 1, 0, 1, info.device, None)
    reference = build_model([*common, "dist.strategy=none"], alone, settings, idle)
    world = range(info.world_size)
    want_loss = sum(loss_of(reference, batch(1 + r, reference)) for r in world) / info.world_size
    want_loss.backward()
    want = full_grads(reference, experts)
    assert sorted(want) == sorted(grads), f"trainable parameters differ: {sorted(set(want) ^ set(grads))}"
    worst, grad_rel, grad_abs = "", 0.0, 0.0
    for name, expected in want.items():
        got = grads[name]
        assert (expected is None) == (got is None), f"a gradient on one side only: {name}"
        if expected is None:
            continue
        assert got is not None and got.shape == expected.shape, (name, got.shape if got is not None else None)
        diff = (got - expected).abs().max().item()
        rel = diff / max(expected.abs().max().item(), 1e-30)
        grad_abs = max(grad_abs, diff)
        if rel > grad_rel:
            worst, grad_rel = name, rel
    got_loss = torch.stack(losses).mean().item()
    return {
        "loss_rel": abs(got_loss - want_loss.item()) / abs(want_loss.item()),
        "grad_rel": grad_rel,
        "grad_abs": grad_abs,
        "worst": worst,
        "trainable": len(want),
        "expert_grads": sum(".experts." in name for name in want),
        "expert_rows": rows_held,
        "idle_zero": None if idle is None else idle_rows_zero(grads, idle, experts) and idle_rows_zero(
            want, idle, experts),
    }


def main() -> None:
    result_file, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    info = dist.init(load_config(TINY, ["dist.timeout_s=120"]).dist)
    if info.is_main:
        result_file.write_text("")
    for job, spec in jobs.items():
        for lora in (True, False):
            try:
                parallel = spec.get("parallel", ["dist.strategy=fsdp", "dist.expert_parallel=2"])
                figures, error = compare(spec["settings"], spec["idle"], lora, info, parallel), None
            except Exception:  # whatever it is, reported for this job alone
                figures, error = {}, traceback.format_exc()
            errors: list[str | None] = [None] * info.world_size
            torch_dist.all_gather_object(errors, error)
            error = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)
            line = json.dumps({"job": job, "lora": lora, "loss_rel": None, "grad_rel": None, **figures,
                               "ok_error": error})
            if info.is_main:
                with result_file.open("a") as out:
                    out.write(line + "\n")
                print(line, flush=True)
    dist.exit_process(0)


if __name__ == "__main__":
    main()
