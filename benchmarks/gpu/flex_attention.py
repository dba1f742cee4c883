"""trainyard's flex_attention on a GPU (model/flex.py): exact against each family's eager attention, and the memory
it saves on long documents. Needs CUDA; one JSON line per check. A benchmark, never run by the test suite.

    python benchmarks/gpu/flex_attention.py                  # both checks
    python benchmarks/gpu/flex_attention.py --only exact     # or: memory

exact: Gemma 2 (soft-capping) and gpt-oss (sinks), tiny configs with windows shorter than the documents, three
documents in one padding-free row through the compiled flex kernel, against the family's eager attention on each
document alone: relative loss and largest relative gradient difference, fp32, plain, under activation
checkpointing and under trainyard's selective policy (on a CPU only torch's dense flex could be checked:
tests/unit/model/test_flex.py; there, under checkpointing, Gemma 2's score_mod gave wrong gradients (full) or
"Trying to backward an extra time" (selective), while gpt-oss, which has none, was exact: check it here first).

memory: one gpt-oss-20b-wide decoder layer (64 heads of 64, 8 key/value heads, full attention) in bf16, one document
of --tokens tokens, forward and backward: torch.cuda.max_memory_allocated under flex against varlen (the family's
eager attention on the document, whose [64, L, L] scores it holds: 8 GiB in bf16 at 8k tokens).
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from transformers import AutoConfig, AutoModelForCausalLM

from trainyard.model import attention, flex  # noqa: F401  (flex registers attention.FLEX)
from trainyard.parallel.checkpointing import selective_policy

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "gemma2": dict(sliding_window=8, attn_logit_softcapping=0.5, final_logit_softcapping=5.0, head_dim=16,
                   query_pre_attn_scalar=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"]),
}
DOCUMENTS = (200, 130, 270)
CUDA = torch.device("cuda")


def build(family: str, implementation: str, **changes: Any) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **{**BASE, **FAMILIES[family], **changes})
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(CUDA)


def documents() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, BASE["vocab_size"], (n,), generator=generator).to(CUDA) for n in DOCUMENTS]


def eager_reference(family: str) -> tuple[torch.nn.Module, float]:
    model = build(family, "eager")
    total, count = 0.0, 0
    for doc in documents():
        out = model(input_ids=doc[None], labels=doc[None], use_cache=False)
        total, count = total + out.loss * (len(doc) - 1), count + len(doc) - 1
    loss = total / count
    loss.backward()
    return model, loss.item()


def packed_loss(model: torch.nn.Module) -> torch.Tensor:
    docs = documents()
    positions = torch.cat([torch.arange(len(d), device=CUDA) for d in docs])[None]
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100], device=CUDA)]) for d in docs])
    logits = model(input_ids=torch.cat(docs)[None], position_ids=positions, use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)


def exact(family: str, checkpointing: str) -> dict[str, Any]:
    ref, ref_loss = eager_reference(family)
    model = build(family, attention.FLEX)
    model.load_state_dict(ref.state_dict())
    if checkpointing != "none":
        context = {"context_fn": partial(create_selective_checkpoint_contexts, selective_policy(0))}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={
            "use_reentrant": False, **(context if checkpointing == "selective" else {})})
    loss = packed_loss(model)
    loss.backward()
    grads = [((mine.grad - theirs.grad).abs().max() / theirs.grad.abs().max().clamp_min(1e-12)).item()
             for mine, theirs in zip(model.parameters(), ref.parameters()) if theirs.grad is not None]
    return {"check": "exact", "family": family, "checkpointing": checkpointing,
            "loss_rel": abs(loss.item() - ref_loss) / ref_loss, "grad_rel": max(grads)}


def memory(implementation: str, tokens: int) -> dict[str, Any]:
    config = AutoConfig.for_model("gpt_oss", vocab_size=1024, hidden_size=2880, intermediate_size=2880,
                                  num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                  num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"],
                                  max_position_embeddings=max(tokens, 4096))
    config._attn_implementation = implementation
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(CUDA)
    ids = torch.randint(3, 1024, (1, tokens), device=CUDA)
    positions = torch.arange(tokens, device=CUDA)[None]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model(input_ids=ids, position_ids=positions, use_cache=False).logits.float().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return {"check": "memory", "implementation": implementation, "tokens": tokens, "peak_above_weights_gib":
            round(peak / 2**30, 3), "device": torch.cuda.get_device_name(0), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["exact", "memory"])
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flex_attention.py needs a CUDA GPU (on a CPU: pytest tests/unit/model/test_flex.py)")
    if args.only in (None, "exact"):
        for family in FAMILIES:
            for checkpointing in ("none", "full", "selective"):
                try:
                    print(json.dumps(exact(family, checkpointing)), flush=True)
                except Exception as err:  # report and go on: one failing mode must not hide the others
                    print(json.dumps({"check": "exact", "family": family, "checkpointing": checkpointing,
                                      "error": f"{type(err).__name__}: {err}"[:2000]}), flush=True)
    if args.only in (None, "memory"):
        for implementation in (attention.FLEX, attention.VARLEN):
            try:
                print(json.dumps(memory(implementation, args.tokens)), flush=True)
            except torch.OutOfMemoryError as err:
                print(json.dumps({"check": "memory", "implementation": implementation, "error": str(err)[:500]}))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
