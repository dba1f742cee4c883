"""What the MoE routers did over a log window: tokens per expert per layer, and the router's auxiliary
(load-balancing) loss as transformers defines it.

Read from each router's own output (transformers 5 routers return logits, weights and the chosen experts), by a
forward hook that counts only training forwards: not eval, and not the forward that activation checkpointing
recomputes inside the backward, which would count every token twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from trainyard.model import nf4_experts

_LAYER = re.compile(r"\.layers\.(\d+)\.")
ROUTER_NAMES = ("gate", "router")
EXPERT_PARALLEL_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss",
                            "qwen3_next", "granitemoehybrid", "lfm2_moe")
"""The families whose expert parallelism is proven exact (tests/dist/test_expert_parallel.py): parallel's EP runs
them, the plan's `auto` considers them, any other is refused. The last three are hybrids (Gated DeltaNet, Mamba and
short-convolution layers beside attention): EP moves only the routed experts' tokens, and those layers run whole on
each rank's own rows, as on one process."""


@dataclass(frozen=True)
class Router:
    layer: int
    module: torch.nn.Module
    experts: int


def find_routers(model: torch.nn.Module) -> list[Router]:
    """The router of every MoE block: the `gate` or `router` beside an `experts` module of 3-D expert stacks."""
    found = []
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        held = _stacked_experts(experts)
        if held is None:
            continue
        router = next((getattr(block, n) for n in ROUTER_NAMES if isinstance(getattr(block, n, None), torch.nn.Module)),
                      None)
        layer = _LAYER.search(f".{name}.")
        if router is not None and layer is not None:
            # expert parallelism: this rank holds some of the experts, the router chooses among all
            exchange = next((m.token_exchange for m in experts.modules() if hasattr(m, "token_exchange")), None)
            count = exchange.experts if exchange else held
            found.append(Router(int(layer[1]), router, count))
    return sorted(found, key=lambda r: r.layer)


def _stacked_experts(experts: Any) -> int | None:
    """The experts a module of 3-D expert stacks holds (stacks model.quantize nf4 holds per expert too); None for
    anything else."""
    if not isinstance(experts, torch.nn.Module):
        return None
    stacked = next((p.shape[0] for p in experts.parameters() if p.dim() == 3), None)
    return stacked if stacked is not None else nf4_experts.expert_count(experts)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ExpertLoad:
    """Per MoE layer: tokens routed to each expert (top-k choices), the routers' summed probabilities and the
    tokens seen, on this rank since the last reset. `row` flattens them for the log window's one all-gather."""

    def __init__(self, routers: list[Router], device: torch.device) -> None:
        self.layers = [r.layer for r in routers]
        self.experts = routers[0].experts if routers else 0
        shape = (len(routers), self.experts)
        self.counts = torch.zeros(shape, dtype=torch.float64, device=device)
        self.probs = torch.zeros(shape, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(len(routers), dtype=torch.float64, device=device)
        self._hooks = [r.module.register_forward_hook(self._hook(slot)) for slot, r in enumerate(routers)]

    def _hook(self, slot: int) -> Any:
        def record(module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if not module.training or _in_backward() or not isinstance(output, tuple) or len(output) < 3:
                return
            logits, chosen = output[0].detach(), output[2].detach()
            with torch.no_grad():
                # A count of fixed size: bincount sizes its output from the data, one host sync per layer on a GPU.
                flat = chosen.reshape(-1)
                self.counts[slot].index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float64, device=flat.device))
                self.probs[slot] += logits.float().softmax(dim=-1).sum(dim=0).to(torch.float64)
                self.tokens[slot] += logits.shape[0]

        return record

    def reset(self) -> None:
        for tensor in (self.counts, self.probs, self.tokens):
            tensor.zero_()

    def row(self) -> torch.Tensor:
        return torch.cat([self.counts.flatten(), self.probs.flatten(), self.tokens])

    def figures(self, summed: torch.Tensor) -> dict[str, Any]:
        """From the row summed over ranks: `router_aux_loss` (transformers' load_balancing_loss_func over every
        MoE layer's tokens at once: experts x sum_e fraction routed to e x mean probability of e), and per layer the
        tokens per expert, max over mean, and the experts that got no token."""
        n = len(self.layers) * self.experts
        counts = summed[:n].view(len(self.layers), self.experts)
        probs = summed[n : 2 * n].view(len(self.layers), self.experts)
        tokens = summed[2 * n :]
        seen = tokens.sum().clamp(min=1.0)
        aux = float(self.experts * (counts.sum(0) / seen * probs.sum(0) / seen).sum())
        mean = counts.mean(dim=1).clamp(min=1e-9)
        return {
            "router_aux_loss": aux,
            "expert_load": {
                "layers": self.layers,
                "max_over_mean": [round(v, 4) for v in (counts.max(dim=1).values / mean).tolist()],
                "idle_experts": [[int(e) for e in torch.nonzero(row == 0).flatten()] for row in counts],
                "tokens_per_expert": [[int(v) for v in row] for row in counts.tolist()],
            },
        }

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def idle_by_layer(load: dict[str, Any] | None) -> dict[int, list[int]]:
    """Layer -> experts that no token reached in the window (`ExpertLoad.figures`' expert_load)."""
    if not load:
        return {}
    return {layer: idle for layer, idle in zip(load["layers"], load["idle_experts"], strict=True) if idle}
