"""LoRA via PEFT: adapters on the linear layers (their update added inside the adapter's product: lora_linear.py)
and on fused MoE expert parameters (run as grouped low-rank products: moe_lora.py), the router frozen unless named,
every target name checked, and what carries adapters, in words.

Only plain linear maps get adapters: a Linear whose class replaces the forward (Llama 4's router returns a tuple) or
whose weight its parent hands to a fused kernel (a Mamba mixer's out_proj; Jamba's dt_proj) would crash, or have its
adapter silently skipped, so the defaults leave them out and a target naming one is refused.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer, ParamWrapper
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
from safetensors.torch import load_file

from trainyard.config import LoraConfig
from trainyard.errors import ModelError
from trainyard.model.layers import not_plain_linear
from trainyard.model.lora_linear import use_fused_linear_adapters
from trainyard.model.moe_lora import use_grouped_expert_adapters


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int, reference: bool = False) -> torch.nn.Module:
    """Freeze the base and add adapters: the linear layers (all but the head by default) and the
    routed experts' fused 3-D parameters (by default, on MoE models), after checking that every
    name given exists, since PEFT only warns about a name that matches nothing. lora.init_from: the adapters
    start as that saved adapter, and with `reference` (DPO) a frozen copy of it is added as REFERENCE."""
    if cfg.init_from is not None:
        peft_config = saved_adapter_config(Path(cfg.init_from))
    else:
        target_parameters = resolve_target_parameters(model, cfg)
        check_lora_targets(model, cfg.target_modules, target_parameters)
        not_plain = not_plain_linear(model)
        refuse_not_plain(cfg.target_modules, not_plain)
        peft_config = PeftLoraConfig(
            r=cfg.r,
            lora_alpha=cfg.alpha,
            lora_dropout=cfg.dropout,
            target_modules=cfg.target_modules,
            target_parameters=target_parameters or None,
            exclude_modules=sorted(not_plain) if cfg.target_modules == "all-linear" and not_plain else None,
            task_type="CAUSAL_LM",
        )
    torch.manual_seed(seed)
    try:
        with known_peft_warnings_ignored():
            keep_router_frozen(model, peft_config, cfg)
            peft_model = get_peft_model(model, peft_config)
    except ValueError as err:  # peft's "Target modules {...} not found", or a parameter adapter's own limits
        if "lora_dropout" in str(err):
            raise ModelError(
                f"lora.dropout={cfg.dropout}: adapters on parameters (MoE experts) cannot use dropout ({err})",
                fix="set lora.dropout: 0",
            ) from None
        raise ModelError(
            f"lora.target_modules: {err}", fix="use names of the model's linear layers, or all-linear"
        ) from None
    if cfg.init_from is not None:
        start_from_adapter(peft_model, Path(cfg.init_from), reference)
    if cfg.moe_adapter == "grouped":
        use_grouped_expert_adapters(peft_model)
    use_fused_linear_adapters(peft_model)
    return peft_model


REFERENCE = "reference"
"""The frozen adapter DPO's reference runs with (lora.init_from); the trained one is PEFT's "default"."""
ADAPTER_FIX = "point lora.init_from at a PEFT adapter folder: a checkpoint's adapter/ or an export's adapter/"


def saved_adapter_config(folder: Path) -> PeftLoraConfig:
    try:
        config = PeftLoraConfig.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as err:
        raise ModelError(f"lora.init_from: cannot read a PEFT adapter config in {folder} ({err})",
                         fix=ADAPTER_FIX) from None
    if not (folder / "adapter_model.safetensors").is_file():
        raise ModelError(f"lora.init_from: {folder} has no adapter_model.safetensors", fix=ADAPTER_FIX)
    config.inference_mode = False
    return config


def start_from_adapter(model: PeftModel, folder: Path, reference: bool) -> None:
    """The saved adapter's tensors into the trained adapter and, with `reference`, into a frozen second one."""
    state = load_file(str(folder / "adapter_model.safetensors"))
    names = ["default"]
    if reference:
        model.add_adapter(REFERENCE, model.peft_config["default"])
        names.append(REFERENCE)
    for name in names:
        result = set_peft_model_state_dict(model, state, adapter_name=name)
        if result.unexpected_keys:
            raise ModelError(f"lora.init_from: {folder} holds tensors this model has no place for, e.g. "
                             f"{result.unexpected_keys[0]}", fix="start from an adapter trained on this model")
    model.base_model.set_adapter("default")  # the one trained and active; PEFT marks the others frozen too
    for param_name, param in model.named_parameters():
        if f".{REFERENCE}." in param_name:
            param.requires_grad_(False)


ROUTER = "gate"
"""The router's pre-fusion name: PEFT 0.21 maps it (in target_modules, all-linear included) to `gate.weight`."""


def keep_router_frozen(model: torch.nn.Module, peft_config: PeftLoraConfig, cfg: LoraConfig) -> None:
    """Resolve PEFT's v4 → v5 MoE renames now (PEFT runs them again inside get_peft_model; a second pass changes
    nothing) and drop the router's `gate.weight` unless the job names it: all-linear would otherwise give every
    router an adapter, which moves the routing of a model whose experts were trained with it."""
    convert_peft_config_for_transformers(peft_config, model=model, conversions=None)
    if _names_router(cfg) or not isinstance(peft_config.target_parameters, set | list):
        return
    router = f"{ROUTER}.weight"
    peft_config.target_parameters = {name for name in peft_config.target_parameters if name != router}


def _names_router(cfg: LoraConfig) -> bool:
    modules = cfg.target_modules if isinstance(cfg.target_modules, list) else []
    parameters = cfg.target_parameters if isinstance(cfg.target_parameters, list) else []
    return any(t == ROUTER or t.endswith(f".{ROUTER}") for t in modules) or any(
        t == f"{ROUTER}.weight" or t.endswith(f".{ROUTER}.weight") for t in parameters
    )


@contextlib.contextmanager
def real_stand_ins(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Give meta parameters a real stand-in (one element, broadcast: no memory) for the block.

    PEFT creates adapters on the device and in the dtype of the weight they adapt; over a meta
    base they would land on meta and lose their seeded init. Over a stand-in they are real, in
    `dtype` (fp32 masters for bf16-mixed), drawn exactly as over a loaded base."""
    swapped: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                pair = swapped.setdefault(id(param), (param, _stand_in(param, dtype)))
                module._parameters[name] = pair[1]
    try:
        yield
    finally:
        originals = {id(stand_in): param for param, stand_in in swapped.values()}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and id(param) in originals:
                    module._parameters[name] = originals[id(param)].requires_grad_(param.requires_grad)


def _stand_in(param: torch.nn.Parameter, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros((), dtype=dtype).expand(param.shape), requires_grad=param.requires_grad)


@contextlib.contextmanager
def known_peft_warnings_ignored() -> Iterator[None]:
    """PEFT checks its rank/alpha patterns against adapted modules only: the doubled rank it gives fused
    gate_up_proj experts (a parameter) does apply, yet it warns that the pattern was ignored. And PEFT 0.21 reads
    transformers 5's deprecated `is_gradient_checkpointing`, whose FutureWarning is theirs to fix, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match")
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def resolve_target_parameters(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """`auto`: the model's 3-D parameters (fused MoE experts), named relative to their block; not a convolution's
    kernel (a short causal convolution's [channels, 1, width] is no stack of matrices)."""
    if cfg.target_parameters != "auto":
        return list(cfg.target_parameters)
    return _unique(
        _block_relative(f"{module_name}.{name}" if module_name else name)
        for module_name, module in model.named_modules()
        if not isinstance(module, torch.nn.modules.conv._ConvNd)
        for name, param in module.named_parameters(recurse=False)
        if param.ndim == 3
    )


def refuse_not_plain(target_modules: list[str] | str, not_plain: dict[str, str]) -> None:
    """An explicit target naming a Linear that is not a plain linear map: PEFT would crash on it or train an adapter
    the forward skips."""
    if not isinstance(target_modules, list):
        return
    named = {full: why for full, why in not_plain.items()
             if any(full == t or full.endswith(f".{t}") for t in target_modules)}
    if named:
        kinds = _unique(f"{_block_relative(full)} ({why})" for full, why in named.items())
        raise ModelError(
            f"lora.target_modules: {', '.join(kinds)}: LoRA adapts plain linear maps only",
            fix="remove it from lora.target_modules (all-linear leaves it frozen)",
        )


def check_lora_targets(model: torch.nn.Module, target_modules: list[str] | str, target_parameters: list[str]) -> None:
    """Every name must match a module (or parameter) as PEFT matches them: whole name or dotted suffix."""
    if isinstance(target_modules, list):
        missing = _unmatched(target_modules, [name for name, _ in model.named_modules()])
        if missing:
            linear = _unique(
                _block_relative(name) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
            )
            raise ModelError(
                f"lora.target_modules: {', '.join(missing)} match no module of this model; "
                f"its linear layers are: {', '.join(linear)}",
                fix="use some of those names, or all-linear",
            )
    missing = _unmatched(target_parameters, [name for name, _ in model.named_parameters()])
    if missing:
        reachable = parameter_targets(model)
        have = ", ".join(reachable) or "none (no fused experts: use lora.target_modules)"
        raise ModelError(
            f"lora.target_parameters: {', '.join(missing)} match no parameter of this model; "
            f"its parameters outside linear and embedding layers are: {have}",
            fix="use some of those names, [] for none, or auto",
        )


def parameter_targets(model: torch.nn.Module) -> list[str]:
    """Weights that only target_parameters reaches: matrices and expert stacks outside linear and embedding layers."""
    plain = (torch.nn.Linear, torch.nn.Embedding)
    return _unique(
        _block_relative(f"{module_name}.{name}" if module_name else name)
        for module_name, module in model.named_modules()
        if not isinstance(module, plain)
        for name, param in module.named_parameters(recurse=False)
        if param.ndim >= 2
    )


def describe_lora_reach(model: torch.nn.Module) -> str:
    """What carries adapters: '14 modules, 4 expert parameters (2 layers × mlp.experts.gate_up_proj, ...)'."""
    modules, experts, others = 0, [], []
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            key = f"{name.replace('.base_layer', '')}.{module.parameter_name}"
            (experts if module.get_param().ndim == 3 else others).append(key)
        elif isinstance(module, LoraLayer):
            modules += 1
    words = f"{modules} modules"
    if experts:
        layers = len({key.removesuffix(_block_relative(key)) for key in experts})
        kinds = ", ".join(_unique(map(_block_relative, experts)))
        words += f", {len(experts)} expert parameters ({layers} layers × {kinds})"
    if others:
        words += f", {len(others)} other parameters ({', '.join(_unique(map(_block_relative, others)))})"
    excluded = [getattr(config, "exclude_modules", None) for config in getattr(model, "peft_config", {}).values()]
    frozen = _unique(_block_relative(name) for names in excluded if isinstance(names, list | set) for name in names)
    if frozen:
        words += f"; not plain linear maps, left frozen: {', '.join(frozen)}"
    return words


def _unmatched(targets: list[str], names: list[str]) -> list[str]:
    return [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in names)]


def _block_relative(name: str) -> str:
    """'model.layers.3.mlp.experts.down_proj' → 'mlp.experts.down_proj': the name within a repeated block."""
    parts = name.split(".")
    indices = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[indices[-1] + 1 :]) if indices else name


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def max_lora_rank(model: torch.nn.Module) -> int:
    """The widest adapter rank (0 without LoRA), rank patterns included (PEFT doubles it on fused experts)."""
    if not isinstance(model, PeftModel):
        return 0
    return max(max([config.r, *config.rank_pattern.values()]) for config in model.peft_config.values())


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The reference model for the forwards inside: each LoRA layer runs its frozen REFERENCE adapter where it has
    one (lora.init_from), or no adapter, then goes back as it was. The layers' own switches, not PEFT's
    disable_adapter()/set_adapter(): they reach the layers through any DDP or FSDP2 wrapping, and leave
    requires_grad (which FSDP2's sharded parameters were built with) alone."""
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    was = [(layer._disable_adapters, layer._active_adapter) for layer in layers]
    for layer in layers:
        if REFERENCE in getattr(layer, "lora_A", {}) or REFERENCE in getattr(layer, "lora_A_params", {}):
            layer._active_adapter = [REFERENCE]
        else:
            layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, (off, active) in zip(layers, was, strict=True):
            layer._disable_adapters, layer._active_adapter = off, active
