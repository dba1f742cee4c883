"""Run under torchrun: build each job the way `trainer.run` does (meta device, wrap, then each
rank's own weights) and compare every weight with what transformers loads by itself.

argv: strategy, a JSON list of [label, config overrides, HF folder or "", lora], result dir. Under expert
parallelism the experts EP ranks hold apart are compared as whole stacks (gathered from every rank).
Each rank writes <result dir>/<label>-rank<r>.json: mismatching tensors, the share of the
model's elements it holds, and whether a tied pair stayed one tensor.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from trainyard import dist
from trainyard.train import build
from trainyard import precision
from trainyard.model import weights
from trainyard.parallel import expert_parallel
from trainyard.parallel import parallelize as parallel
from trainyard.model import source as source_room
from trainyard.config_file import load_config

TINY = str(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml")


def reference(cfg, folder: str, tokenizer) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    """The whole model as today's one-process code built it: from_pretrained, or seeded from_config."""
    if folder:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        config = source_room.architecture(cfg.model, tokenizer)
        torch.manual_seed(cfg.train.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if cfg.lora.enabled:
        torch.manual_seed(cfg.train.seed)
        model = get_peft_model(model, PeftLoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                     target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM"))
    return model


def _key(name: str) -> str:
    """Base weights by checkpoint name; adapters by full name (nested expert wrappers differ only there)."""
    return name if "lora_" in name else weights.checkpoint_key(name)


def compare(label: str, overrides: list[str], folder: str, strategy: str, out: Path) -> None:
    cfg = load_config(TINY, [*overrides, f"dist.strategy={strategy}", "train.precision=fp32"])
    info = dist.init(cfg.dist)
    tokenizer = source_room.load_tokenizer(cfg.model, folder or None)
    model, _, _ = build.build_and_wrap(cfg, info, precision.resolve(cfg, info.device), folder or None, tokenizer)
    wanted = {_key(k): v for k, v in reference(cfg, folder, tokenizer).state_dict().items()}
    net = parallel.unwrap(model)
    mismatched, held, total = [], 0, 0
    for name, tensor in expert_parallel.whole_stacks(net, net.state_dict()).items():  # EP: whole expert stacks
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        held, total = held + local.numel(), total + tensor.numel()
        full = expert_parallel.peft_layout(name, tensor.full_tensor()) if isinstance(tensor, DTensor) else tensor
        key = _key(name)
        if key not in wanted or not torch.equal(full.float(), wanted[key].float()):
            mismatched.append(name)
    base = net.get_base_model() if hasattr(net, "get_base_model") else net
    tied = base.config.tie_word_embeddings and base.lm_head.weight is base.model.embed_tokens.weight
    result = {"mismatched": mismatched, "held_share": held / total, "tied": bool(tied),
              "meta_left": [n for n, p in net.named_parameters() if p.is_meta]}
    (out / f"{label}-rank{os.environ['RANK']}.json").write_text(json.dumps(result))


def main() -> None:
    strategy, jobs, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    for label, overrides, folder in jobs:
        compare(label, overrides, folder, strategy, out)
    dist.exit_process(0)


if __name__ == "__main__":
    main()
