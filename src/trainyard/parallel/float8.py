"""train.precision fp8: the decoder blocks' linear layers swapped for torchao's Float8Linear before anything wraps
them, so their products run in FP8 (tensorwise or rowwise scales) while weights, adapters and the rest stay as
bf16-mixed keeps them. Under FSDP2 with tensorwise scales the weights are all-gathered in FP8.

It enters through parallelize.apply, never the loop. torchao is imported here only, when a job asks for fp8 (it
costs seconds and logs about kernels this machine may not have).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from typing import Any

import torch

from trainyard.errors import ConfigError
from trainyard.precision import Precision, fp8_linears

# The first compute capability with FP8 tensor cores (Ada: L4, RTX 4090; Hopper is 9.0).
FP8_CAPABILITY = (8, 9)


def refusal(device: torch.device) -> str | None:
    """Why `device` cannot run FP8 products, naming it; None where it can."""
    if device.type != "cuda":
        return f"this process runs on {device.type.upper()}, which has no FP8 matrix units"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; FP8 products need "
                f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or more (L4, H100, H200)")
    return None


def require_device(device: torch.device, where: str) -> None:
    """Refuse fp8 with exit 2 where the device cannot run it."""
    why = refusal(device)
    if why is not None:
        raise ConfigError(f"fp8: {why}", where=where,
                          fix="set train.precision: bf16-mixed (or auto), or run on an L4, H100 or H200")


def config(scaling: str, all_gather: bool, emulate: bool = False) -> Any:  # -> Float8LinearConfig
    """torchao's recipe for `scaling`; FP8 all-gather only for tensorwise scales (torchao's own restriction).
    `emulate`: products in high precision from FP8-rounded operands, for a machine without FP8 units (tests)."""
    from torchao.float8 import Float8LinearConfig

    if scaling == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(scaling), emulate=emulate)


def convert(model: torch.nn.Module, scaling: str, all_gather: bool,
            emulate: bool = False) -> tuple[list[str], list[str]]:
    """Swap every linear that precision.fp8_linears selects for a Float8Linear, in place; the names converted and
    those kept in bf16. State dicts keep plain tensors under the same keys (checkpoints and exports as bf16-mixed
    writes them)."""
    converted, kept = fp8_linears(model)
    if not converted:
        return converted, kept
    chosen = set(converted)
    with _quiet():
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda _module, name: name in chosen,
                                   config=config(scaling, all_gather, emulate))
    for name in converted:
        model.get_submodule(name)._register_state_dict_hook(_plain_weight)
    return converted, kept


def apply(model: torch.nn.Module, precision: Precision, device: torch.device, sharded: bool, where: str) -> None:
    """parallelize.apply's step for fp8: refuse a device without FP8 units, convert, and log what stays bf16."""
    if precision.fp8_scaling is None:
        return
    if any(type(param).__name__ == "NF4Tensor" for param in model.parameters()):
        raise ConfigError("fp8 with model.quantize nf4: the 4-bit base is dequantized to bf16 for each product, which "
                          "FP8 cannot take", where=where,
                          fix="set train.precision: bf16-mixed, or model.quantize: none")
    require_device(device, where)
    gathers = sharded and precision.fp8_scaling == "tensorwise"
    converted, kept = convert(model, precision.fp8_scaling, all_gather=gathers)
    log = logging.getLogger("trainyard")
    log.info("fp8 (%s scales): %d linear layers compute in FP8%s", precision.fp8_scaling, len(converted),
             ", all-gathered in FP8" if gathers else "")
    if kept:
        log.info("fp8: %d linear layers stay bf16, their dimensions not multiples of 16: %s", len(kept),
                 ", ".join(kept))


def _plain_weight(module: torch.nn.Module, state: dict[str, Any], prefix: str, _local: Any) -> None:
    """A weight wrapped for FP8 all-gather is saved as the tensor it wraps (under FSDP2, the DTensor of it)."""
    key = prefix + "weight"
    value = state.get(key)
    if value is None:
        return
    local = value._local_tensor if hasattr(value, "_local_tensor") else value
    inner = getattr(local, "_tensor", None)
    if inner is None:
        return
    inner = inner.detach()  # the wrapped Parameter itself: a state dict holds detached tensors
    if local is value:
        state[key] = inner
    else:
        from torch.distributed.tensor import DTensor

        state[key] = DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False,
                                        shape=value.shape, stride=value.stride())


@contextlib.contextmanager
def _quiet() -> Any:
    """torchao's import prints about optional kernels a machine lacks (mxfp8, cutlass): not the user's concern."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield
