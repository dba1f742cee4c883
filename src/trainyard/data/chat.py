"""Chat rows -> token ids whose labels are exactly the assistant replies, under any chat template.

Many real templates render a turn differently once more turns follow it (Qwen3 drops the reasoning of earlier
replies, gpt-oss ends them with <|end|> instead of <|return|>), so rendering a prefix of a conversation does not
give a prefix of its rendering. The conversation is therefore rendered once, and each reply is located in that
text: a template that marks replies with `{% generation %}` says where they are itself (transformers'
`return_assistant_tokens_mask`); otherwise each reply's text is learned by rendering the conversation up to it
with the same template and kwargs, and found after the end of the previous one. A reply that cannot be found
is a bad row, never a guess.

What is trained of a reply: what the model generates after the template's generation prompt, through the
template's end-of-turn text (trailing whitespace after it excluded): `Hello!<|im_end|>`, `Hello!<|eot_id|>`,
`<|channel|>final<|message|>Hello!<|end|>`; Qwen3's `<think>` block where the template keeps it (the last reply).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from transformers.utils.chat_template_utils import _compile_jinja_template

from trainyard.config import DataConfig
from trainyard.errors import ConfigError, DataError

IGNORE_INDEX = -100
TEMPLATES_DIR = Path(__file__).parent / "templates"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
CANNOT_MASK = "chat template cannot be masked"


class BadRow(Exception):
    """A row that cannot become a training example; `reason` is its key in the skip counts."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


# ---------------------------------------------------------------- the template


@dataclass(frozen=True)
class ChatTemplate:
    """The Jinja text rows are rendered with (None: the tokenizer's own) and the kwargs it is given."""

    text: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def source(self, tokenizer: Any) -> str | None:
        return self.text if self.text is not None else getattr(tokenizer, "chat_template", None)


def family_templates() -> list[str]:
    """The names data.chat_template accepts besides a path: the .jinja files shipped in data/templates/."""
    return sorted(path.stem for path in TEMPLATES_DIR.glob("*.jinja"))


def chat_template_for(cfg: DataConfig) -> ChatTemplate:
    """data.chat_template (a family name or a Jinja file) and data.chat_template_kwargs, read and checked once."""
    if cfg.chat_template is None:
        return ChatTemplate(kwargs=dict(cfg.chat_template_kwargs))
    name = cfg.chat_template
    path = TEMPLATES_DIR / f"{name}.jinja" if name in family_templates() else Path(name).expanduser()
    return ChatTemplate(_read_template(path), dict(cfg.chat_template_kwargs))


def _read_template(path: Path) -> str:
    known = ", ".join(family_templates())
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"data.chat_template: cannot read the Jinja file {path} ({type(err).__name__}: {err})",
            fix=f"point data.chat_template at a readable UTF-8 .jinja file, or use a known template: {known}",
        ) from None
    try:
        _compile_jinja_template(text)  # transformers' own environment: it knows {% generation %}
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(
            f"data.chat_template: {path} is not a valid Jinja template ({err.message})",
            where=f"{path}:{err.lineno}",
            fix="fix the template at that line, or use a known template: " + known,
        ) from None
    return text


def check_chat_tokenizer(tokenizer: Any, template: ChatTemplate) -> None:
    """Fail once, before the first row, when chat rows cannot be encoded with this tokenizer."""
    if not template.source(tokenizer):
        raise DataError(
            "the data is in chat format but the tokenizer has no chat template",
            fix="set data.chat_template to a known template (" + ", ".join(family_templates()) + ") or a .jinja "
            "file, use an instruction-tuned model's tokenizer (model.tokenizer), or convert the data to alpaca or text",
        )
    if not tokenizer.is_fast:
        raise DataError(
            "chat data needs a fast tokenizer (offset mappings locate the assistant turns)",
            fix="use a tokenizer with a tokenizer.json (PreTrainedTokenizerFast)",
        )


# ---------------------------------------------------------------- rows -> messages


def _text_of(content: Any, number: int) -> str:
    """A message's text: a string, or OpenAI content parts of type text (joined by newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise BadRow("missing field", f"message {number} has no text 'content'")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadRow(
                "unsupported content part",
                f"message {number} has a content part of type '{kind}'; only text parts can be trained",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _from_sharegpt(turns: Any) -> list[Any]:
    """ShareGPT `conversations` ({from: human|gpt|system, value}) as messages."""
    if not isinstance(turns, list) or not turns:
        raise BadRow("missing field", "'conversations' must be a non-empty list")
    messages = []
    for number, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES:
            found = turn.get("from") if isinstance(turn, dict) else type(turn).__name__
            raise BadRow("unknown role", f"conversation turn {number} is from {found!r}: use human, gpt or system")
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")})
    return messages


def chat_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as messages with text content; a prompt-only one with a string `answer` gets it as reply."""
    messages = row["messages"] if "messages" in row else _from_sharegpt(row.get("conversations"))
    if not isinstance(messages, list) or not messages:
        raise BadRow("missing field", "'messages' must be a non-empty list")
    checked = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRow("missing field", f"message {number} has no 'role'")
        checked.append({**message, "content": _text_of(message.get("content"), number)})
    if isinstance(row.get("answer"), str) and checked[-1]["role"] != "assistant":
        checked.append({"role": "assistant", "content": row["answer"]})
    assistant = [m for m in checked if m["role"] == "assistant"]
    if not assistant:
        raise BadRow("empty response", "no assistant message")
    if any(not m["content"].strip() for m in assistant):
        raise BadRow("empty response", "an assistant message is empty")
    return checked


# ---------------------------------------------------------------- rendering


Render = Callable[[list[dict[str, Any]], bool], str]


def renderer(tokenizer: Any, template: ChatTemplate) -> Render:
    """messages, generation_prompt -> text, with the job's template and kwargs; template errors are bad rows."""

    def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages,
                chat_template=template.text,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **template.kwargs,
            )
        except Exception as err:  # jinja raises its own errors (e.g. "roles must alternate")
            raise BadRow("chat template failed", f"{type(err).__name__}: {err}") from None

    return render


# ---------------------------------------------------------------- locating the replies


def _shared_prefix(a: str, b: str) -> int:
    size = 0
    for x, y in zip(a, b):
        if x != y:
            break
        size += 1
    return size


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1].strip()


def _after_shared_tail(full: str, prompt: str, cursor: int, anchor: str) -> int | None:
    """End of the first place after `cursor` where `full` holds the longest tail of `prompt` (one holding
    `anchor`): where the reply starts when the template renders the history differently in the whole text."""
    low, high = 0, len(prompt)
    while low < high:  # a tail that occurs has every shorter tail occurring too
        size = (low + high + 1) // 2
        if full.find(prompt[-size:], cursor) >= 0:
            low = size
        else:
            high = size - 1
    tail = prompt[-low:] if low else ""
    if not tail or anchor not in tail:
        return None
    return full.find(tail, cursor) + len(tail)


def _reply_start(render: Render, messages: list[dict[str, Any]], i: int, full: str, cursor: int) -> int:
    """Where reply i begins in `full`: right after its generation prompt."""
    prompt = render(messages[:i], True)
    if full.startswith(prompt) and len(prompt) >= cursor:
        return len(prompt)
    history = render(messages[:i], False)
    shared = _shared_prefix(full, prompt)
    if prompt.startswith(history) and shared >= max(len(history), cursor):
        return shared  # the whole text leaves out part of the generation prompt (Qwen3's empty think block)
    anchor = _last_line(messages[i - 1]["content"]) if i and messages[i - 1]["content"].strip() else ""
    start = _after_shared_tail(full, prompt, cursor, anchor)
    if start is None:
        raise BadRow(
            CANNOT_MASK,
            f"the prompt of message {i} (assistant) is not in the rendered conversation: the template is not "
            "prefix-stable in a way that can be followed",
        )
    return start


def _kept_tail(whole: str, rest: str, content: str) -> int | None:
    """Length of the longest end of `whole` (a rendering that ends with reply i) that `rest` starts with and that
    holds the reply's last line: the part of a reply a template keeps in context (Qwen3 drops the reasoning)."""
    line = _last_line(content)
    content_end = whole.rfind(line)
    if not line or content_end < 0:
        return None
    for start in range(content_end + 1):
        if whole[start] == rest[0] and rest.startswith(whole[start:]):
            return len(whole) - start
    return None


def _reply_length(render: Render, messages: list[dict[str, Any]], i: int, full: str, start: int) -> int:
    """How many characters of `full` from `start` are reply i, through its end-of-turn text."""
    rest = full[start:]
    prompt = render(messages[:i], True)
    last = render(messages[: i + 1], False)
    as_last = last[len(prompt) :].rstrip() if last.startswith(prompt) else ""
    if as_last and rest.startswith(as_last):
        return len(as_last)
    followed = render(messages[: i + 1], True)  # gpt-oss ends a reply that is followed by more with <|end|>
    generation_prompt = prompt[len(render(messages[:i], False)) :]
    if followed.startswith(prompt) and generation_prompt and followed.endswith(generation_prompt):
        as_followed = followed[len(prompt) : len(followed) - len(generation_prompt)].rstrip()
        if as_followed and rest.startswith(as_followed):
            return len(as_followed)
    kept = _kept_tail(last.rstrip(), rest, messages[i]["content"]) if rest else None
    if kept is None:
        raise BadRow(CANNOT_MASK, f"the reply of message {i} (assistant) is not in the rendered conversation")
    return kept


def reply_spans(render: Render, messages: list[dict[str, Any]], full: str) -> list[range]:
    """Character spans of `full` that are assistant replies, in order, each found after the previous one."""
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _reply_start(render, messages, i, full, cursor)
        end = start + _reply_length(render, messages, i, full, start)
        spans.append(range(start, end))
        cursor = end
    return spans


# ---------------------------------------------------------------- encoding


def _token_in_spans(start: int, end: int, spans: list[range]) -> bool:
    end = max(end, start + 1)  # zero-width offsets still sit at a position
    return any(start < span.stop and end > span.start for span in spans)


def _generation_marked(tokenizer: Any, template: ChatTemplate, messages: list[dict[str, Any]]) -> tuple[list, list]:
    """ids and labels from the template's own {% generation %} marks (transformers' assistant mask)."""
    try:
        encoded = tokenizer.apply_chat_template(
            messages,
            chat_template=template.text,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **template.kwargs,
        )
    except Exception as err:
        raise BadRow("chat template failed", f"{type(err).__name__}: {err}") from None
    ids = list(encoded["input_ids"])
    if not any(encoded["assistant_masks"]):
        raise BadRow(CANNOT_MASK, "the template's {% generation %} blocks mark no token of this conversation")
    labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, encoded["assistant_masks"], strict=True)]
    return ids, labels


def _located(tokenizer: Any, render: Render, messages: list[dict[str, Any]], train_on_prompt: bool) -> tuple:
    """ids and labels from the replies located in the rendered conversation."""
    full = render(messages, False)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    if train_on_prompt:
        return ids, list(ids)
    spans = reply_spans(render, messages, full)
    labels = [
        token if _token_in_spans(start, end, spans) else IGNORE_INDEX
        for token, (start, end) in zip(ids, encoded["offset_mapping"], strict=True)
    ]
    return ids, labels


def encode_chat(row: dict[str, Any], tokenizer: Any, template: ChatTemplate, train_on_prompt: bool) -> dict[str, Any]:
    """input_ids and labels of a chat row (plus prompt_ids and response when it ends with a reply)."""
    messages = chat_messages(row)
    render = renderer(tokenizer, template)
    source = template.source(tokenizer) or ""
    if GENERATION_BLOCK.search(source) and not train_on_prompt:
        ids, labels = _generation_marked(tokenizer, template, messages)
    else:
        ids, labels = _located(tokenizer, render, messages, train_on_prompt)
    example: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if messages[-1]["role"] == "assistant":
        prompt = render(messages[:-1], True)
        example["prompt_ids"] = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        example["response"] = messages[-1]["content"]
    return example
