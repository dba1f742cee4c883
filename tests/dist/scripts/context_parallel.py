"""Run under torchrun (2 or 4 ranks): for each job, with LoRA and with full fine-tuning, build the model the way
training does (`build.build_and_wrap`, dist.strategy fsdp, dist.context_parallel 2, fp32), collate one padding-free
row of several documents through the training collator (each rank its slice; one document crosses the slice boundary
and the row's odd length is padded), run the training loss with the loop's scale (world / global targets), and
compare the ranks' summed loss and every trainable parameter's gradient with a 1-process build on rank 0 that takes
the whole row. On 4 ranks there are two CP groups (CP 2 x FSDP 2: the weights sharded over all four); both take the
same row, so the ranks' loss is twice the row's and FSDP's average over the world gives the row's gradient. A job's
"sharded" overrides (e.g. dist.expert_parallel 2, an MoE family) apply to the sharded build alone: under EP each
rank's slice is routed to the experts of its EP group, and the EP ranks' expert gradients are put back together
(the expert_parallel script's helpers) before they are compared.

argv: result file, a JSON object {job: {"settings": HF config settings (model_type included), "parallel": extra
overrides, "sharded": overrides of the sharded build only}}. Rank 0 writes one JSON line per (job, lora): job, lora,
loss_rel, grad_rel, worst, trainable, slices (each rank's [tokens, targets, real tokens, first position]),
expert_rows (the expert_parallel script's), expert_grads (the routed experts' tensors with a gradient), ok_error. A
failure is caught per job."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as torch_dist

from expert_parallel import EXPERT_KEYS, expert_rows, full_grads, perturb_adapters  # this folder's script
from trainyard import dist, precision
from trainyard.config_file import load_config
from trainyard.data.collate import collate
from trainyard.data.formats import IGNORE_INDEX
from trainyard.model import source as source_room
from trainyard.objective import Sft
from trainyard.parallel import context_parallel, expert_parallel
from trainyard.train import build

TINY = str(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml")
DOCUMENTS = (20, 13, 28)
"""61 tokens: padded to 62, each rank 31; the second document (tokens 20-32) crosses the boundary at 31, and every
document is longer than the windows (8)."""


def rows() -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(7)
    docs = [torch.randint(3, 90, (n,), generator=generator).tolist() for n in DOCUMENTS]
    return [{"input_ids": d, "labels": [IGNORE_INDEX, *d[1:]]} for d in docs]


def experts_of(settings: dict) -> int:
    """Routed experts per MoE block (1 for a dense model: nothing is held apart)."""
    return next((settings[k] for k in EXPERT_KEYS if k in settings), 1)


def build_model(overrides: list[str], info: dist.DistInfo, experts: int) -> tuple[torch.nn.Module, int]:
    """The job as training builds it; every lora_B the same seeded values by name in both builds (an EP rank's
    expert adapters: its experts' columns), so lora_A's gradients are not zero."""
    cfg = load_config(TINY, overrides)
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    model, _, _ = build.build_and_wrap(cfg, info, precision.resolve(cfg, info.device), None, tokenizer)
    if cfg.lora.enabled:
        groups = expert_parallel.expert_parallel_groups(model)
        group = next(iter(groups.values()), None)
        ep_rank, ep_size = (torch_dist.get_rank(group), torch_dist.get_world_size(group)) if groups else (0, 1)
        perturb_adapters(model, experts, set(groups), ep_rank, ep_size)
    model.train()
    return model, tokenizer.pad_token_id


def compare(settings: dict, lora: bool, info: dist.DistInfo, parallel: list[str], sharded_only: list[str]) -> dict:
    experts = experts_of(settings)
    common = [f"model.config={json.dumps(settings)}", "model.tokenizer=builtin:bytes", "train.precision=fp32",
              f"lora.enabled={str(lora).lower()}", "model.attn_implementation=auto", "data.padding_free=true"]
    overrides = [*common, "dist.strategy=fsdp", "dist.context_parallel=2", *parallel, *sharded_only]
    sharded, pad_id = build_model(overrides, info, experts)
    rows_held = expert_rows(sharded)
    context = context_parallel.slice_of(sharded)
    batch = collate(rows(), pad_id, True, context)
    objective = Sft()
    targets = torch.tensor([float(objective.count(batch))])
    dist.all_reduce_sum(targets)
    slice_facts = [batch["input_ids"].size(1), objective.count(batch), int(batch["real_tokens"]),
                   int(batch["position_ids"][0, 0])]
    loss_sum = objective.loss_sum(sharded, batch, info.device)
    (loss_sum * info.world_size / targets.item()).backward()  # the loop's scale: FSDP averages over the world
    summed = dist.all_reduce_sum(loss_sum.detach().clone())
    slices: list[list[int] | None] = [None] * info.world_size
    torch_dist.all_gather_object(slices, slice_facts)
    grads = full_grads(sharded, experts)
    del sharded
    if not info.is_main:
        return {}
    alone = dist.DistInfo(0, 1, 0, 1, info.device, None)
    reference, _ = build_model([*common, "dist.strategy=none", *parallel], alone, experts)
    whole = collate(rows(), pad_id, True)
    want_loss = objective.loss_sum(reference, whole, info.device)
    replicas = info.world_size // context[1]  # CP groups, each taking the same row
    assert objective.count(whole) * replicas == targets.item(), (objective.count(whole), targets.item())
    (want_loss / objective.count(whole)).backward()
    want = full_grads(reference, experts)
    assert sorted(want) == sorted(grads), f"trainable parameters differ: {sorted(set(want) ^ set(grads))}"
    worst, grad_rel = "", 0.0
    for name, expected in want.items():
        got = grads[name]
        assert expected is not None and got is not None and got.shape == expected.shape, name
        rel = (got - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)
        if rel > grad_rel:
            worst, grad_rel = name, rel
    got_loss = summed.item() / replicas
    return {"loss_rel": abs(got_loss - want_loss.item()) / abs(want_loss.item()), "grad_rel": grad_rel,
            "worst": worst, "trainable": len(want), "slices": slices, "expert_rows": rows_held,
            "expert_grads": sum(".experts." in name for name in want)}


def main() -> None:
    result_file, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    info = dist.init(load_config(TINY, ["dist.timeout_s=120"]).dist)
    if info.is_main:
        result_file.write_text("")
    for job, spec in jobs.items():
        for lora in (True, False):
            try:
                parallel, sharded_only = spec.get("parallel", []), spec.get("sharded", [])
                figures, error = compare(spec["settings"], lora, info, parallel, sharded_only), None
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
