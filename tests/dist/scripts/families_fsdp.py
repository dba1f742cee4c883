"""Run under torchrun (2 ranks): for each model family, with LoRA and with full fine-tuning, build the job the
way training does (`build.build_and_wrap`, dist.strategy fsdp, fp32, attention auto), run one forward and
backward on one padding-free micro-batch (the same on every rank), and compare the loss and every trainable
parameter's gradient (FSDP2's shards gathered) with the unsharded model of a 1-process build on rank 0.

argv: result file, a JSON object {family: HF config settings (model_type included)}.
Rank 0 writes one JSON line per (family, lora): family, lora, loss_rel, grad_rel, trainable (trainable parameter
tensors compared), trainable_elements, attention (the implementation both builds chose), worst (the parameter
with the largest gradient difference), ok_error (null, or the first failing rank's exception and traceback).
A failure is caught per job, so it hides no other job.
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

from trainyard import dist
from trainyard import loss as loss_room
from trainyard.train import build
from trainyard import precision
from trainyard.model import source as source_room
from trainyard.config_file import load_config
from trainyard.data.collate import padding_free_batch
from trainyard.data.formats import IGNORE_INDEX

TINY = str(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml")
DOCUMENTS = (20, 13, 27)
"""Longer than the families' sliding windows (8), so a window lost under FSDP would change the loss."""
WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "module"})
"""Name parts wrappers may add (FSDP1, activation checkpointing, torch.compile, DDP); PEFT's are in both builds."""


def batch() -> dict[str, torch.Tensor]:
    """3 documents of seeded token ids in one row, position_ids restarting per document; each document's first
    label IGNORE_INDEX (transformers' convention: label t is predicted from position t - 1)."""
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in DOCUMENTS]
    return padding_free_batch([{"input_ids": d, "labels": [IGNORE_INDEX, *d[1:]]} for d in docs])


def loss_of(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over the target tokens: the logit at t against the next token of its own document."""
    logits = model(input_ids=rows["input_ids"], position_ids=rows["position_ids"], use_cache=False).logits
    targets = rows["labels"][:, 1:]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def key(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def perturb_adapters(model: torch.nn.Module) -> None:
    """LoRA's B starts at zero, which would leave every lora_A gradient zero and the adapters out of the forward:
    give every lora_B the same seeded values (by name) in both builds, each FSDP2 rank its own shard."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" not in name:
                continue
            generator = torch.Generator().manual_seed(zlib.crc32(key(name).encode()))
            full = torch.randn(param.shape, generator=generator, dtype=torch.float32).mul_(0.05).to(param.dtype)
            if isinstance(param, DTensor):
                param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
            else:
                param.copy_(full)


def build_model(overrides: list[str], info: dist.DistInfo) -> torch.nn.Module:
    cfg = load_config(TINY, overrides)
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    model, strategy, _ = build.build_and_wrap(cfg, info, precision.resolve(cfg, info.device), None, tokenizer)
    expected = "fsdp" if info.distributed else "none"
    assert strategy == expected, f"built with strategy {strategy}, not {expected}"
    if cfg.lora.enabled:
        perturb_adapters(model)
    return model


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's whole gradient, by name without wrapper prefixes (a collective under FSDP2:
    every rank calls it, in the same order)."""
    grads: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        grads[key(name)] = None if grad is None else grad.detach().float().clone()
    return grads


def compare(family: str, settings: dict, lora: bool, info: dist.DistInfo) -> dict:
    common = [f"model.config={json.dumps(settings)}", "model.tokenizer=builtin:bytes", "train.precision=fp32",
              f"lora.enabled={str(lora).lower()}", "model.attn_implementation=auto"]
    rows = batch()
    sharded = build_model([*common, "dist.strategy=fsdp"], info)
    attention = sharded.config._attn_implementation
    sharded_names = [n for n, p in sharded.named_parameters()]
    assert all(isinstance(p, DTensor) for p in sharded.parameters()), "a parameter is not sharded by FSDP2"
    net = sharded.get_base_model() if hasattr(sharded, "get_base_model") else sharded
    ends = [dist.is_fsdp(end) for end in (net.get_input_embeddings(), net.get_output_embeddings())]
    chunked = loss_room.chunkable_head(sharded, None) is not None
    loss = loss_of(sharded, rows)
    loss.backward()
    grads = full_grads(sharded)
    del sharded
    if not info.is_main:
        return {}
    alone = dist.DistInfo(0, 1, 0, 1, info.device, None)
    reference = build_model([*common, "dist.strategy=none"], alone)
    assert [key(n) for n in sharded_names] == [key(n) for n, _ in reference.named_parameters()], "names differ"
    assert reference.config._attn_implementation == attention, (reference.config._attn_implementation, attention)
    want_loss = loss_of(reference, rows)
    want_loss.backward()
    want = full_grads(reference)
    assert sorted(want) == sorted(grads), f"trainable parameters differ: {sorted(set(want) ^ set(grads))}"
    worst, grad_rel, missing = "", 0.0, []
    top = max((g.abs().max().item() for g in want.values() if g is not None), default=0.0)
    for name, expected in want.items():
        got = grads[name]
        if (expected is None) != (got is None):
            missing.append(name)
            continue
        if expected is None:
            continue
        assert got is not None and got.shape == expected.shape, (name, None if got is None else got.shape)
        rel = (got - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)
        if rel > grad_rel:
            worst, grad_rel = name, rel
    assert not missing, f"a gradient on one side only: {missing}"
    assert top > 0, "every gradient is zero"
    return {
        "loss": want_loss.item(),
        "attention": attention,
        "loss_rel": abs(loss.item() - want_loss.item()) / abs(want_loss.item()),
        "grad_rel": grad_rel,
        "worst": worst,
        "trainable": len(want),
        "trainable_elements": sum(p.numel() for p in reference.parameters() if p.requires_grad),
        "no_grad": [name for name, g in want.items() if g is None],
        "ends_apart": ends, "tied": bool(reference.config.tie_word_embeddings), "chunked": chunked,
    }


def main() -> None:
    result_file, families = Path(sys.argv[1]), json.loads(sys.argv[2])
    info = dist.init(load_config(TINY, ["dist.timeout_s=120"]).dist)
    assert info.world_size == 2, info
    if info.is_main:
        result_file.write_text("")
    for family, settings in families.items():
        for lora in (True, False):
            try:
                figures, error = compare(family, settings, lora, info), None
            except Exception:  # whatever it is, reported for this job alone
                figures, error = {}, traceback.format_exc()
            errors: list[str | None] = [None] * info.world_size
            torch_dist.all_gather_object(errors, error)  # a failure on either rank is reported
            error = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)
            line = json.dumps({"family": family, "lora": lora, "loss_rel": None, "grad_rel": None, "trainable": 0,
                               **figures, "ok_error": error})
            if info.is_main:
                with result_file.open("a") as out:  # line by line: a hang later still leaves these
                    out.write(line + "\n")
                print(line, flush=True)
    dist.exit_process(0)


if __name__ == "__main__":
    main()
