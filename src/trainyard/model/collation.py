"""How a job's rows are collated for a built model: one padding-free row of documents, or padded rows of one
document each where a layer would carry state across the documents of a row and no split keeps it to each
(state_layers.py); the refusals for rows that would hold several documents regardless."""

from __future__ import annotations

import torch

from trainyard.config.data import DataConfig
from trainyard.errors import ModelError
from trainyard.model import attention, layers, state_layers


def one_row(implementation: str, data: DataConfig, model: torch.nn.Module | None = None) -> bool:
    """Whether each micro-batch is collated as one padding-free row: data.padding_free, or packed rows meeting a
    flash kernel, unless the built `model` has layers that would carry state across its documents (padded_rows).
    transformers' flash path reads documents from position_ids only in a batch of one row (`_is_packed_sequence`):
    packed rows of a larger batch would each attend causally across their documents. Flattening them is exact: the
    same documents, tokens and labels, without the padding."""
    if model is not None and padded_rows(model, data):
        return False
    return data.padding_free or (implementation in attention.FLASH and attention.packed_rows(data))


def model_one_row(model: torch.nn.Module, data: DataConfig) -> bool:
    """one_row for a built model: its attention implementation, and its layers (padded_rows)."""
    return one_row(model.config._attn_implementation, data, model)


def padded_rows(model: torch.nn.Module, data: DataConfig) -> str | None:
    """Why the job collates padded rows (one document each, right-padded: exact for every causal layer) though
    data.padding_free asks for one row of documents; None when it does not (no layer carries state, or each that does
    is split per document: state_layers.py). Packed rows or a mixture's are refused for layers left unsplit, and for
    all of them where data.padding_free is off (rows of several documents with no bounds)."""
    carried, why = (layers.carriers(model), "") if attention.packed_rows(data) else ([], "")
    if carried and data.padding_free:  # one row, whose host bounds reach the split state layers
        carried, why = state_layers.unsplit_carriers(model)
    if not carried:
        return None
    why = f" ({why})" if why else ""
    if data.packing or data.mixture is not None:
        field = "data.packing" if data.packing else "data.mixture"
        raise ModelError(
            f"{field}: rows of several documents, but {attention.config_name(model)} has {', '.join(carried)} layers "
            f"that carry state across documents{why or ' (a row of several documents comes without their bounds)'}",
            fix="keep data.padding_free: true with model.attn_implementation: auto (the row's bounds then reach these "
            "layers, where the family has attention), or set data.packing: false and train on a data.path dataset "
            "(its rows are padded for this family)",
        )
    return f"{attention.config_name(model)} has {', '.join(carried)} layers that carry state across documents{why}"


def check_pair_rows(model: torch.nn.Module) -> None:
    """A preference pair is one row of two documents (chosen, rejected), padded or not: a layer that carries state
    across documents would let the rejected response read the chosen one."""
    if carried := layers.carriers(model):
        raise ModelError(
            f"train.objective: dpo puts each pair's chosen and rejected responses in one row, but "
            f"{attention.config_name(model)} has {', '.join(carried)} layers that carry state across documents "
            "(trainyard cannot give them the boundaries yet)",
            fix="train this family with train.objective: sft, or choose a family without such layers for dpo",
        )
