"""Fill a meta-built (and possibly sharded) model with each rank's own weights, and nothing more.

A source gives full-size rows of a named tensor: HF safetensors files, read a slice at a time,
or tensors already in memory (a seeded random init, LoRA adapters). A parameter sharded by
FSDP2/HSDP (a DTensor split along dim 0) asks only for the rows its rank owns, so no rank ever
reads or holds the whole model; a replicated one (DDP, or no wrapper) asks for all rows.

A hub checkpoint may store a tensor under another name or in pieces (Mixtral's per-expert
`block_sparse_moe.experts.N.w1/w3/w2`, Qwen-MoE's and GLM's per-expert projections, renamed legacy
keys): the folder applies transformers' own conversion table for the family (`conversion_mapping`),
as `from_pretrained` does. A fused expert stack is built from the rows' experts alone. A stack that
model.quantize nf4 holds per expert (nf4_experts.py) fills each expert's weight from the stack's rows of
that expert, one expert in memory at a time.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    Interleave,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from trainyard.errors import ModelError
from trainyard.model import nf4_experts, quantize

RowReader = Callable[[int, int], torch.Tensor]
"""Rows [start, stop) along dim 0 of one full tensor, in the source's dtype."""

_PEFT_PREFIX = "base_model.model."


@dataclass
class Converted:
    """A model tensor that transformers' conversion builds from checkpoint tensors (e.g. stacked experts)."""

    converter: WeightConverter
    sources: dict[str, list[str]] = field(default_factory=dict)
    """Checkpoint keys by the converter's source pattern, in transformers' order (experts 0, 1, ...)."""


@dataclass
class SafetensorsFolder:
    """Where every tensor of an HF safetensors folder lives (the index, or the one file), and which model
    tensors the family's conversion table renames or builds from several of them."""

    folder: Path
    files: dict[str, Path] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)
    """Model key -> checkpoint key, where transformers' table renames it."""
    converted: dict[str, Converted] = field(default_factory=dict)
    model: torch.nn.Module | None = None

    @classmethod
    def open(cls, folder: str | Path, model: torch.nn.Module | None = None) -> SafetensorsFolder:
        """The folder's tensors; given the model to fill, with its family's conversions applied."""
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        found = cls(folder)
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            found.files = {key: folder / name for key, name in weight_map.items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise ModelError(
                    f"model.path: {folder} has no *.safetensors files (only safetensors weights are read)",
                    fix="save the model with save_pretrained(safe_serialization=True), or convert its .bin files",
                )
            for file in files:
                for key in _keys(file):
                    found.files[key] = file
        if model is not None:
            found._plan_conversions(model)
        return found

    def _plan_conversions(self, model: torch.nn.Module) -> None:
        """Rename every checkpoint key as from_pretrained would, and group the pieces of converted tensors."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.model = base
        mapping = get_model_conversion_mapping(base)
        renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
        converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        wanted = {checkpoint_key(name): True for name, _ in tensors_to_load(model)}
        prefix = getattr(base, "base_model_prefix", None)
        for key in sorted(self.files, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
            if target == key or target not in wanted or key in wanted:
                continue
            if pattern is None:
                self.renamed.setdefault(target, key)
                continue
            converter = by_pattern[pattern]
            entry = self.converted.setdefault(target, Converted(converter))
            entry.sources.setdefault(pattern, []).append(key)
            for other in converter.target_patterns[1:]:  # one checkpoint tensor split into several (qkv -> q, k, v)
                self.converted.setdefault(target.replace(converter.target_patterns[0], other), entry)

    def rows(self, key: str) -> RowReader | None:
        """A reader of `key`'s rows, or None if the folder does not hold it."""
        source = self.renamed.get(key, key)
        if source in self.files:
            return lambda start, stop: _read_rows(self.files[source], source, start, stop)
        if key in self.converted:
            return lambda start, stop: self._converted_rows(key, start, stop)
        return None

    def _converted_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows of a tensor transformers' conversion builds. Where the first step stacks a list (experts) along
        dim 0 and no later step touches dim 0, only the experts of the rows are read; otherwise the whole."""
        entry = self.converted[key]
        converter = entry.converter
        by_expert = _stacks_rows(converter)
        collected = {
            pattern: [self._whole(name) for name in (names[start:stop] if by_expert else names)]
            for pattern, names in entry.sources.items()
        }
        for operation in converter.operations:
            collected = operation.convert(
                collected,
                source_patterns=converter.source_patterns,
                target_patterns=converter.target_patterns,
                full_layer_name=key,
                model=self.model,
                config=getattr(self.model, "config", None),
            )
        made = next((value for pattern, value in collected.items() if pattern in key), None)
        if made is None:
            raise ModelError(
                f"model.path: {self.folder}: transformers' conversion of {key} gave {', '.join(collected)}",
                fix="check that the folder holds a checkpoint of this model's family",
            )
        made = made[0] if isinstance(made, list) else made
        return made if by_expert else made[start:stop]

    def _whole(self, key: str) -> torch.Tensor:
        return _read_rows(self.files[key], key, None, None)


def _stacks_rows(converter: WeightConverter) -> bool:
    """The converter stacks a list along dim 0 first (MergeModulelist) and then only works on other dims."""
    first, *rest = converter.operations
    if not (isinstance(first, MergeModulelist) and first.dim == 0):
        return False
    return all(isinstance(op, (Concatenate, Chunk, Interleave)) and op.dim != 0 for op in rest)


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as err:
        raise ModelError(f"model.path: cannot read {file}: {err}", fix="check the file (re-download it)") from None


def _read_rows(file: Path, key: str, start: int | None, stop: int | None) -> torch.Tensor:
    """Rows of one tensor. The file is opened per read, so its mapping (and the pages it
    brought into memory) is released at once: a rank's memory holds its rows, not the file."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            sliced = handle.get_slice(key)
            if len(sliced.get_shape()) == 0:
                return sliced[:]
            return sliced[start:stop]
    except (SafetensorError, OSError) as err:
        raise ModelError(f"model.path: cannot read {key} from {file}: {err}", fix="check the file") from None


def checkpoint_key(name: str) -> str:
    """The HF checkpoint name of a model parameter: without PEFT's prefix and base_layer(s) (each
    adapted expert parameter nests one more)."""
    return re.sub(r"(\.base_layer)+\.", ".", name.removeprefix(_PEFT_PREFIX))


def own_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of dim 0 this rank holds: FSDP2 and HSDP shard dim 0 in
    torch.chunk's way (ceil-sized pieces, the last ones shorter or empty); Replicate keeps all."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 1
    start, length = 0, param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard(0):
            pieces = param.device_mesh.size(mesh_dim)
            index = param.device_mesh.get_local_rank(mesh_dim)
            chunk = math.ceil(length / pieces)
            first = min(index * chunk, length)
            start, length = start + first, min(chunk, length - first)
        elif not placement.is_replicate():
            raise ModelError(
                f"cannot load a parameter placed as {placement}", fix="use dist.strategy ddp, fsdp or hsdp"
            )
    return start, start + length


@torch.no_grad()
def copy_own_rows(param: torch.Tensor, read: RowReader, name: str) -> None:
    """Fill this rank's part of `param` from full-size rows, casting to its dtype."""
    local = param.to_local() if isinstance(param, DTensor) else param
    start, stop = own_rows(param)
    if local.numel() == 0:
        return
    if quantize.is_nf4(local):  # streamed in row chunks, this rank's rows quantized as the whole tensor's
        quantize.fill_own_rows(local, _checked_rows(read, tuple(param.shape[1:]), name), param.shape, start, stop)
        return
    rows = read(start, stop)
    expected = tuple(local.shape)
    if tuple(rows.shape) != expected and not (local.dim() == 0 and rows.numel() == 1):
        raise ModelError(
            f"model.path: {name} has shape {tuple(rows.shape)} in rows {start}:{stop}, the model expects {expected}",
            fix="model.path must hold weights of this architecture (check its config.json)",
        )
    local.copy_(rows.reshape(local.shape))


def _checked_rows(read: RowReader, columns: tuple[int, ...], name: str) -> RowReader:
    """`read`, refusing rows of another shape than the model's."""
    def checked(start: int, stop: int) -> torch.Tensor:
        rows = read(start, stop)
        if tuple(rows.shape) != (stop - start, *columns):
            raise ModelError(f"model.path: {name} has shape {tuple(rows.shape)} in rows {start}:{stop}, the model "
                             f"expects {(stop - start, *columns)}",
                             fix="model.path must hold weights of this architecture (check its config.json)")
        return rows
    return checked


def tensors_to_load(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once) and persistent buffers, by their names in the model."""
    yield from model.named_parameters()
    persistent = set(model.state_dict(keep_vars=True).keys())
    for name, buffer in model.named_buffers():
        if name in persistent:
            yield name, buffer


@dataclass
class InMemory:
    """Full tensors by checkpoint name (a seeded random init), served like a folder."""

    tensors: dict[str, torch.Tensor]
    folder: str = "the random init"

    def rows(self, key: str) -> RowReader | None:
        full = self.tensors.get(key)
        if full is None:
            return None
        return lambda start, stop: full[start:stop] if full.dim() else full


def load(
    model: torch.nn.Module,
    source: SafetensorsFolder | InMemory,
    skip: Callable[[str], bool],
    key: Callable[[str], str] = checkpoint_key,
) -> int:
    """Fill every tensor of `model` not `skip`ped with this rank's rows of `source[key(name)]`;
    returns how many. Every missing one is named at once, before any is read."""
    plan = []
    missing = []
    for name, tensor in tensors_to_load(model):
        if skip(name):
            continue
        reader = source.rows(key(name)) or _expert_of_stack(source, key(name))
        if reader is None:
            missing.append(key(name))
        else:
            plan.append((name, tensor, reader))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelError(
            f"model.path: {source.folder} lacks weights the model needs: {shown}",
            fix="point model.path at the whole model saved by save_pretrained, with its config.json",
        )
    for name, tensor, reader in plan:
        copy_own_rows(tensor, reader, name)
    return len(plan)


def _expert_of_stack(source: SafetensorsFolder | InMemory, key: str) -> RowReader | None:
    """The rows of one expert's weight of a fused stack held per expert (nf4_experts), where the source has the
    stack (an expert-parallel source counts the experts from this rank's first)."""
    found = nf4_experts.stack_expert(key)
    stack = source.rows(found[0]) if found else None
    return None if stack is None or found is None else _OneExpert(stack, found[1])


@dataclass
class _OneExpert:
    """Rows of expert `expert` of a fused stack: the expert is read once and held until its last row is asked
    for (the load streams each weight's rows in order), so no more than one expert's copy is ever held."""

    stack: RowReader
    expert: int
    held: torch.Tensor | None = None

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        if self.held is None:
            self.held = self.stack(self.expert, self.expert + 1)[0]
        rows = self.held[start:stop]
        if stop >= self.held.shape[0]:
            self.held = None
        return rows


def adapter_key(name: str) -> str:
    """A LoRA parameter's name in a PEFT adapter file: the adapter's name ("default") left out."""
    return name.replace(".default.", ".")


def load_adapter(model: torch.nn.Module, file: Path) -> int:
    """Each rank's rows of a saved PEFT adapter, into the model's (possibly sharded) trained adapter ("default"; a
    frozen DPO reference adapter keeps what lora.init_from gave it)."""
    source = SafetensorsFolder(file.parent, {key: file for key in _keys(file)})
    return load(model, source, skip=lambda name: "lora_" not in name or ".default." not in name, key=adapter_key)
