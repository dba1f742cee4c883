"""Preference rows -> one row of two documents, the chosen and the rejected reply to one prompt.

TRL's shapes: `prompt` + `chosen` + `rejected`, each a string (standard) or a list of messages (conversational),
or only `chosen` and `rejected` conversations whose shared first turns are the prompt (implicit prompt). Each
document is prompt + completion; its labels are the completion's tokens only. Conversations keep SFT's exact
masks (chat.py: the assistant replies, under the job's template), less the replies inside the prompt. Standard
rows are tokenized as TRL does: the prompt, and prompt + completion + eos as one text, the completion starting
where the two tokenizations part. The pair is stored as a packed row (`seq_lens` [chosen, rejected]), so the
padding-free collate restarts positions at the rejected document and never pads one to the other.
"""

from __future__ import annotations

from typing import Any

from trainyard.data.chat import IGNORE_INDEX, BadRow, ChatTemplate, check_chat_tokenizer, encode_chat, renderer
from trainyard.data.shapes import PAIR_SHAPES, SFT_SHAPES
from trainyard.errors import DataError

PAIR_KEYS = ("chosen", "rejected")


def is_preference(row: dict[str, Any]) -> bool:
    return all(key in row for key in PAIR_KEYS)


def check_objective_fits(objective: str, pairs: bool, path: str) -> None:
    """train.objective dpo reads pairs, sft anything but pairs: the other way round is a DataError before training."""
    if objective == "dpo" and not pairs:
        raise DataError(
            f"train.objective is dpo but data.path {path} holds no preference pairs",
            fix=f"give each row {PAIR_SHAPES}",
        )
    if objective == "sft" and pairs:
        raise DataError(
            f"data.path {path} holds preference pairs (chosen/rejected) but train.objective is sft",
            fix=f"set train.objective: dpo, or give each row one response: {SFT_SHAPES}",
        )


def split_pair(row: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected), the prompt taken from the shared first turns where the row has none."""
    missing = [f"'{key}'" for key in PAIR_KEYS if row.get(key) is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise BadRow("missing field", f"{' and '.join(missing)} {verb} missing (the row has the keys {sorted(row)})")
    chosen, rejected = row["chosen"], row["rejected"]
    if not (isinstance(chosen, str) and isinstance(rejected, str)
            or isinstance(chosen, list) and isinstance(rejected, list)):
        raise BadRow("missing field", "'chosen' and 'rejected' must both be strings or both lists of messages")
    if chosen == rejected:
        raise BadRow("chosen equals rejected", "the pair teaches nothing")
    if "prompt" in row and row["prompt"] is not None:
        prompt = row["prompt"]
        if type(prompt) is not type(chosen):
            raise BadRow("missing field", "'prompt' must be a string with string replies, a list of messages with "
                         "message replies")
        return prompt, chosen, rejected
    if isinstance(chosen, str):
        raise BadRow("missing field", "'prompt' is missing (an implicit prompt needs conversations)")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _check_completion(completion: Any, name: str) -> None:
    empty = not completion.strip() if isinstance(completion, str) else not completion
    if empty:
        raise BadRow("empty completion", f"'{name}' has no reply after the prompt")


def _common_prefix(a: list[int], b: list[int]) -> int:
    size = 0
    for x, y in zip(a, b):
        if x != y:
            break
        size += 1
    return size


def _standard_documents(prompt: str, completions: list[str], tokenizer: Any) -> list[tuple[list[int], int]]:
    """(ids, where the completion starts) per completion, tokenized as TRL's DPOTrainer does."""
    eos = tokenizer.eos_token
    prompt_ids = tokenizer(prompt)["input_ids"]
    fulls = [tokenizer(prompt + text + ("" if text.endswith(eos) else eos))["input_ids"] for text in completions]
    start = min(_common_prefix(prompt_ids, ids) for ids in fulls)
    return [(ids, start) for ids in fulls]


def _conversation_document(prompt: list, completion: list, tokenizer: Any, template: ChatTemplate) -> list[list[int]]:
    """ids and labels: SFT's masks of prompt + completion, the prompt's own replies left out."""
    encoded = encode_chat({"messages": [*prompt, *completion]}, tokenizer, template, train_on_prompt=False)
    ids, labels = encoded["input_ids"], encoded["labels"]
    if prompt:
        prompt_ids = tokenizer(renderer(tokenizer, template)(prompt, True), add_special_tokens=False)["input_ids"]
        start = _common_prefix(prompt_ids, ids)
        labels = [IGNORE_INDEX] * start + labels[start:]
    return [ids, labels]


def encode_pair(row: dict[str, Any], tokenizer: Any, template: ChatTemplate, max_length: int) -> dict[str, Any]:
    """input_ids and labels of the chosen document then the rejected one, and seq_lens [chosen, rejected]. Each
    document is cut at max_length (TRL's keep_start); one left without a completion token is a bad row."""
    prompt, chosen, rejected = split_pair(row)
    if isinstance(prompt, list):
        check_chat_tokenizer(tokenizer, template, "dpo")
    _check_completion(chosen, "chosen")
    _check_completion(rejected, "rejected")
    if isinstance(prompt, str):
        documents = [[ids, [IGNORE_INDEX] * start + ids[start:]]
                     for ids, start in _standard_documents(prompt, [chosen, rejected], tokenizer)]
    else:
        documents = [_conversation_document(prompt, reply, tokenizer, template) for reply in (chosen, rejected)]
    pair: dict[str, Any] = {"input_ids": [], "labels": [], "seq_lens": []}
    for name, (ids, labels) in zip(PAIR_KEYS, documents):
        ids, labels = ids[:max_length], labels[:max_length]
        labels[0] = IGNORE_INDEX  # nothing predicts a document's first token
        if all(label == IGNORE_INDEX for label in labels):
            raise BadRow("empty completion", f"'{name}' keeps no token of its reply within data.max_length "
                         f"{max_length}")
        pair["input_ids"] += ids
        pair["labels"] += labels
        pair["seq_lens"].append(len(ids))
    return pair
