"""Chat rows -> token ids whose labels are exactly the assistant replies, under any chat template.

Many real templates render a turn differently once more turns follow it (Qwen3 drops the reasoning of earlier
replies, gpt-oss ends them with <|end|> instead of <|return|>, a custom template may rewrite them), so rendering a
prefix of a conversation does not give a prefix of its rendering, and a reply's own text need not survive in it.
The conversation is therefore rendered once, and each reply is located in that text: a template that marks replies
with `{% generation %}` says where they are itself (transformers' `return_assistant_tokens_mask`); otherwise a reply
starts after its generation prompt (learned by rendering the conversation up to it) and ends at the template's
end-of-turn text after what the reply became (learned by rendering it with the reply swapped for a probe
character). A reply that cannot be found is a bad row, never a guess.

What is trained of a reply: what the whole rendering holds of the assistant turn after the template's generation
prompt, through its end-of-turn text (trailing whitespace after it excluded): `Hello!<|im_end|>`,
`<|channel|>final<|message|>Hello!<|end|>`; Qwen3's `<think>` block where the template keeps it (the last reply),
only the answer where it drops it (`5<|im_end|>` of `<think>4+1</think>5`).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from transformers.utils.chat_template_utils import _compile_jinja_template

from trainyard.config import DataConfig
from trainyard.data.shapes import Objective
from trainyard.errors import ConfigError, DataError

IGNORE_INDEX = -100
TEMPLATES_DIR = Path(__file__).parent / "templates"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
CANNOT_MASK = "chat template cannot be masked"
# private-use characters: no template writes them or changes them (upper-casing, trimming), so one can stand
# in for a reply's text
PROBES = "\ue000\ue001\ue002\ue003"


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


def _jinja_literal(value: Any) -> str:
    """`value` as a Jinja expression (JSON but for true, false and none, which Jinja spells in lower case)."""
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(_jinja_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_jinja_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value if isinstance(value, int | float | str) else str(value))


def template_with_defaults(text: str, kwargs: dict[str, Any]) -> str:
    """`text` rendering as if given `kwargs` when a caller passes none of them: each becomes its variable's
    default, since a saved tokenizer keeps its template but no kwargs. A caller's own value still wins."""
    lines = [
        f"{{%- if {name} is not defined %}}{{%- set {name} = {_jinja_literal(value)} %}}{{%- endif %}}"
        for name, value in kwargs.items()
        if name.isidentifier()
    ]
    return "".join(lines) + "\n" + text if lines else text  # the block tags' trim drops that newline


def tokenizer_as_trained(tokenizer: Any, cfg: DataConfig) -> Any:
    """The tokenizer to save beside weights: its chat template is the one the job rendered rows with
    (data.chat_template, else its own) holding data.chat_template_kwargs as defaults, so that
    `AutoTokenizer.from_pretrained(folder).apply_chat_template(...)` renders what training saw."""
    template = chat_template_for(cfg)
    source = template.source(tokenizer)
    if not isinstance(source, str) or (template.text is None and not template.kwargs):
        return tokenizer
    trained = copy.deepcopy(tokenizer)
    trained.chat_template = template_with_defaults(source, template.kwargs)
    return trained


def check_chat_tokenizer(tokenizer: Any, template: ChatTemplate, objective: Objective = None) -> None:
    """Fail once, before the first row, when chat rows (dpo: conversation pairs) cannot be encoded with this
    tokenizer."""
    if not template.source(tokenizer):
        rows = "the pairs are conversations" if objective == "dpo" else "the data is in chat format"
        other = ("give the pairs as strings: `prompt` + `chosen` + `rejected`, each a string" if objective == "dpo"
                 else "convert the data to alpaca (`instruction` + `output`) or `text`")
        raise DataError(
            f"{rows} but the tokenizer has no chat template",
            fix="set data.chat_template to a known template (" + ", ".join(family_templates()) + ") or a .jinja "
            f"file, use an instruction-tuned model's tokenizer (model.tokenizer), or {other}",
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
    """Length of the longest common start of a and b (halving, so the comparisons run at C speed)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        size = (low + high + 1) // 2
        if a[:size] == b[:size]:
            low = size
        else:
            high = size - 1
    return low


def _shared_suffix(a: str, b: str) -> int:
    return _shared_prefix(a[::-1], b[::-1])


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1].strip() if text.strip() else ""


def _probe(messages: list[dict[str, Any]], full: str) -> str:
    """A character that neither the conversation nor its rendering holds: it stands in for a reply's text."""
    seen = full + "".join(str(message.get("content")) for message in messages)
    for probe in PROBES:
        if probe not in seen:
            return probe
    raise BadRow(CANNOT_MASK, "the conversation holds every private-use character the template is probed with")


@dataclass(frozen=True)
class _Reply:
    """Reply i of a conversation, with what locating it takes: the whole rendering `full`, the conversation
    before the reply rendered without and with the generation prompt, and a probe character."""

    render: Render
    messages: list[dict[str, Any]]
    i: int
    full: str
    history: str
    prompt: str
    probe: str

    @property
    def opening(self) -> str | None:
        """The generation prompt: what the template writes between the history and a reply."""
        return self.prompt[len(self.history) :] if self.prompt.startswith(self.history) else None

    def probed(self, *after: dict[str, Any], generation_prompt: bool = False) -> str | None:
        """The history, a reply that is only the probe, then `after`; None if the template refuses it."""
        messages = [*self.messages[: self.i], {"role": "assistant", "content": self.probe}, *after]
        try:
            return self.render(messages, generation_prompt)
        except BadRow:
            return None


def _after_shared_tail(full: str, text: str, cursor: int, anchor: str) -> int | None:
    """End of the first place after `cursor` where `full` holds the longest tail of `text` (one holding `anchor`):
    where the history ends when the template renders it differently in the whole conversation."""
    low, high = 0, len(text)
    while low < high:  # a tail that occurs has every shorter tail occurring too
        size = (low + high + 1) // 2
        if full.find(text[-size:], cursor) >= 0:
            low = size
        else:
            high = size - 1
    tail = text[-low:] if low else ""
    if not tail or anchor not in tail:
        return None
    return full.find(tail, cursor) + len(tail)


def _earlier_turn_header(reply: _Reply) -> str:
    """What the template writes before the text of a reply that more turns follow: where a reply starts when the
    whole text does not hold its generation prompt (Qwen3 without thinking prompts with an empty <think> block
    that a reply rendered with its reasoning lacks; a template may open earlier replies with a header of its own)."""
    followed = reply.probed({"role": "user", "content": reply.probe})
    if followed is None or not followed.startswith(reply.history):
        return ""
    turn = followed[len(reply.history) :]
    return turn[: turn.index(reply.probe)] if reply.probe in turn else ""


def _reply_start(reply: _Reply, cursor: int) -> int:
    """Where the reply begins in the whole text: after its generation prompt, or, where the whole text holds
    something else there, after what the template writes before the text of an earlier reply."""
    full, history = reply.full, reply.history
    if full.startswith(reply.prompt) and len(reply.prompt) >= cursor:
        return len(reply.prompt)
    if full.startswith(history) and len(history) >= cursor:
        history_end: int | None = len(history)
    else:  # the whole text renders earlier turns differently: find where this history ends by its last text
        anchor = _last_line(reply.messages[reply.i - 1]["content"]) if reply.i else ""
        history_end = _after_shared_tail(full, history, cursor, anchor)
    if history_end is not None and reply.opening is not None:
        if full.startswith(reply.opening, history_end):
            return history_end + len(reply.opening)
        header = _earlier_turn_header(reply)
        if header and full.startswith(header, history_end):
            return history_end + len(header)
    raise BadRow(
        CANNOT_MASK,
        f"the prompt of message {reply.i} (assistant) is not in the rendered conversation: the template is not "
        "prefix-stable in a way that can be followed",
    )


def _turn_ends(reply: _Reply) -> set[str]:
    """What the template writes after a reply's text: as the last message, and when a generation prompt follows
    (gpt-oss: <|return|>, <|end|>); the whitespace after it is not part of the reply."""
    ends = set()
    last = reply.probed()
    if last is not None and reply.probe in last:
        ends.add(last[last.rindex(reply.probe) + 1 :].rstrip())
    followed, opening = reply.probed(generation_prompt=True), reply.opening
    if followed is not None and opening and followed.endswith(opening) and reply.probe in followed:
        ends.add(followed[followed.rindex(reply.probe) + 1 : len(followed) - len(opening)].rstrip())
    return ends


def _swapped(reply: _Reply, k: int) -> str | None:
    """The whole conversation rendered with message k's text swapped for the probe; None if the template refuses."""
    messages = reply.messages
    try:
        return reply.render([*messages[:k], {**messages[k], "content": reply.probe}, *messages[k + 1 :]], False)
    except BadRow:
        return None


def _reply_end(reply: _Reply, start: int) -> int:
    """Where the reply ends in the whole text: at the first end-of-turn text after what its text became there, and
    before the next message's text. Both are learned by rendering the conversation with a message's text swapped
    for the probe, so nothing of the reply need survive the template (Qwen3 keeps only the answer of an earlier
    reply; a template may rewrite it)."""
    i, full = reply.i, reply.full
    swapped = _swapped(reply, i)  # refused: the reply ends at the first end-of-turn text
    text_end = start if swapped is None else max(start, len(full) - _shared_suffix(full, swapped))
    following = _swapped(reply, i + 1) if i + 1 < len(reply.messages) else None
    limit = len(full) if following is None else _shared_prefix(full, following)
    limit = limit if limit > start else len(full)  # a template may move the next message (a system one) up
    found = [(full.find(end, text_end), -len(end)) for end in _turn_ends(reply) if end in full[text_end:limit]]
    if not found:
        raise BadRow(CANNOT_MASK, f"the end of message {i} (assistant) is not in the rendered conversation")
    position, minus_length = min(found)  # the nearest end; of two found at once, the longer
    return position - minus_length


def reply_spans(render: Render, messages: list[dict[str, Any]], full: str) -> list[range]:
    """Character spans of `full` that are assistant replies, in order, each found after the previous one."""
    spans, cursor, probe = [], 0, _probe(messages, full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        reply = _Reply(render, messages, i, full, render(messages[:i], False), render(messages[:i], True), probe)
        start = _reply_start(reply, cursor)
        end = _reply_end(reply, start)
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
