"""LoRA on a linear layer with its update added inside the adapter's second product.

PEFT's `lora.Linear` computes `base(x) + lora_B(lora_A(x)) * scaling`: two passes over the layer's whole output (a
scale, then an add), and two more in the backward. Here `addmm(base(x), lora_A(x), lora_Bᵀ, alpha=scaling)` does
both inside the rank-r product, so only [tokens, r] tensors are ever scaled, forward or backward. Same function,
same parameters, names, init, saving and merging: only `forward` differs, and PEFT's own runs whenever an adapter
is merged, disabled, a variant (DoRA), biased, or more than one is active. In the bench step's profile the scale and
the add were ~10% of a LoRA step of SmolLM2-135M on CPU (benchmarks/cpu/profile_step.py).
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from trainyard.model.nf4_linear import NF4Linear


class FusedLoraLinear(LoraLinear):
    """PEFT's `lora.Linear`, whose plain single-adapter forward adds the update in the adapter's product."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = self._plain_adapter() if not args and not kwargs else None
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        lora_A, lora_B = self.lora_A[adapter], self.lora_B[adapter]
        result = self.base_layer(x)
        dropout = self.lora_dropout[adapter]
        if torch.is_autocast_enabled(x.device.type) and isinstance(dropout, torch.nn.Identity):
            # autocast casts x for the product itself: PEFT's cast to the adapter's dtype first (fp32) is undone
            # by it, exactly, and cost two copies of x forward and two of its gradient backward
            low = lora_A(x)
        else:
            low = lora_A(dropout(self._cast_input_dtype(x, lora_A.weight.dtype)))
        second = lora_B.weight.t()
        if not torch.is_autocast_enabled(x.device.type) and not result.dtype == low.dtype == second.dtype:
            return (result + lora_B(low) * self.scaling[adapter]).to(result.dtype)
        out = torch.addmm(result.reshape(-1, result.shape[-1]), low.reshape(-1, low.shape[-1]), second,
                          alpha=self.scaling[adapter])
        return out.view(result.shape).to(result.dtype)

    def _plain_adapter(self) -> str | None:
        """The one active adapter when it is plain LoRA over an unmerged nn.Linear (an NF4 one too), else None."""
        if self.disable_adapters or self.merged or type(self.base_layer) not in (torch.nn.Linear, NF4Linear):
            return None
        active = [name for name in self.active_adapters if name in self.lora_A]
        if len(active) != 1 or active[0] in self.lora_variant or self.lora_B[active[0]].bias is not None:
            return None
        return active[0]


def use_fused_linear_adapters(model: torch.nn.Module) -> int:
    """Run every PEFT `lora.Linear` as `FusedLoraLinear`; returns how many. A class swap, not a bound method, so the
    module stays PEFT's (state dict, merge, save) and survives deepcopy."""
    swapped = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            module.__class__ = FusedLoraLinear
            swapped += 1
    return swapped
