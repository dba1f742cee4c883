"""Each claimed family of transformers' registry (registry.py) under trainyard's default job, against the family's
own eager model on padded rows (one document a row): 4 plain SGD steps in fp32 on the same three documents, the
mean cross-entropy over every target before each step. A family is `exact` on padding-free rows, `padded` (trainyard
collates its rows padded, saying why, and is exact there), or `refused` (exit 2, the reason trainyard gives).

The outcomes are committed (MATRIX): test_registry_families.py checks they are what the code gives now, and
docs/gen.py writes the support table from them.

    python -m tests.unit.model.matrix     # recompute every family and rewrite MATRIX
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tests.unit.model import registry
from trainyard.config import DataConfig
from trainyard.data.collate import collate
from trainyard.errors import ModelError
from trainyard.model import collation
from trainyard.model import attention, state_layers
from trainyard.model import build as _registers_implementations  # noqa: F401
from trainyard.model.documents import model_inputs

MATRIX = Path(__file__).with_name("family_matrix.json")
STEPS, LR, TOLERANCE = 4, 0.02, 1e-5
DOCUMENTS = (20, 13, 27)
CPU = torch.device("cpu")
EXACT, PADDED, REFUSED = "exact", "padded", "refused"
SAMPLES_IN_TRAINING = {"phimoe"}
"""Families whose router samples experts in training mode (PhiMoE's sparsemixer): the row's shape changes the draws,
so both sides run in eval mode, which changes nothing else here (every dropout is 0)."""


def build(model_type: str, implementation: str = "eager") -> PreTrainedModel:
    config = AutoConfig.for_model(**registry.settings(model_type))
    config._attn_implementation = implementation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train(model_type not in SAMPLES_IN_TRAINING)


def rows() -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, registry.TINY["vocab_size"], (n,), generator=generator).tolist() for n in DOCUMENTS]
    return [{"input_ids": doc, "labels": [-100, *doc[1:]]} for doc in docs]


def losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[float]:
    """STEPS SGD steps on the batch as the training loop feeds it (model_inputs): the loss before each."""
    inputs = model_inputs(batch, CPU, model.config)
    targets = batch["labels"][:, 1:]
    seen = []
    for _ in range(STEPS):
        logits = model(**inputs, use_cache=False).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                                 ignore_index=-100)
        loss.backward()
        sgd_step(model, LR)
        seen.append(loss.item())
    return seen


def sgd_step(model: torch.nn.Module, lr: float) -> None:
    """Plain gradient descent: both sides of a comparison take the same update, with no optimizer state."""
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param -= lr * param.grad
                param.grad = None


def outcome(model_type: str) -> dict[str, Any]:
    """What trainyard's default job does with the family: its result, why (padded or refused), the worst relative
    difference from eager on padded rows over the steps (exact or padded)."""
    model = build(model_type)
    try:
        model.config._attn_implementation = attention.choose("auto", model, CPU)
    except ModelError as err:
        return {"result": REFUSED, "why": err.what}
    state_layers.install(model)  # as build_meta_model does
    want = losses(build(model_type), collate(rows(), pad_id=0, padding_free=False))
    data = DataConfig()
    why = collation.padded_rows(model, data)
    got = losses(model, collate(rows(), pad_id=0, padding_free=collation.model_one_row(model, data)))
    worst = max(abs(a - b) / b for a, b in zip(got, want))
    return {"result": PADDED if why else EXACT, "why": why, "rel": worst}


def main(families: list[str]) -> None:
    table = json.loads(MATRIX.read_text()) if MATRIX.exists() else {}
    for model_type in families or registry.claimed():
        found = outcome(model_type)
        print(model_type, found, flush=True)
        table[model_type] = {key: value for key, value in found.items() if key != "rel"}
    MATRIX.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
