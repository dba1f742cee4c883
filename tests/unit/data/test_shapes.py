"""Every data error names the rows of the job's own train.objective (dpo: the preference shapes, sft: SFT's, never
the other's), the field at fault and its file:line. One table, run under both objectives through the dry run (the
CLI in this process, exit 2) and through prepare_datasets (what `train` and `eval` call)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli
from tests.unit.data.conftest import write_jsonl
from trainyard.config import DataConfig
from trainyard.data import build_byte_tokenizer, prepare_datasets
from trainyard.errors import DataError

SFT = "`instruction` + `output`"
DPO = "`prompt` + `chosen` + `rejected`"
NAMES = {"sft": (SFT, DPO), "dpo": (DPO, SFT)}
"""(the shapes an error must name, the other objective's that it must not)."""
PAIR = {"prompt": "2+2=", "chosen": "4", "rejected": "five"}
GOOD = {"sft": {"instruction": "Add 2 and 2.", "output": "4"}, "dpo": PAIR}
OWN = "own"
"""Stands in a table's rows for a row the objective trains on."""
LACKS_REJECTED = {"prompt": "x", "chosen": "a"}
WIDE = {"COLUMNS": "1000"}


@dataclass
class Case:
    id: str
    rows: list
    expect: dict[str, list[str]]
    """Per objective, what its message must hold besides the shapes; an objective the rows fit is absent."""
    data: dict[str, str] = field(default_factory=dict)
    eval_rows: list | None = None


CASES = [
    Case("pair-lacks-a-field", [OWN, LACKS_REJECTED],
         {"dpo": ["rows.jsonl:2", "'rejected' is missing"], "sft": ["rows.jsonl:2", "'instruction' is missing"]}),
    Case("first-row-lacks-a-field", [LACKS_REJECTED],
         {"dpo": ["rows.jsonl:1", "'rejected' is missing", "['chosen', 'prompt']"],
          "sft": ["rows.jsonl:1", "cannot tell the data format", "['chosen', 'prompt']"]}),
    Case("sft-rows", [{"text": "hello"}], {"dpo": ["rows.jsonl:1", "'chosen' and 'rejected' are missing", "['text']"]}),
    Case("pair-rows", [PAIR], {"sft": ["rows.jsonl:1", "preference pair", "train.objective: dpo"]}),
    Case("alpaca-lacks-output", [OWN, {"instruction": "x"}],
         {"dpo": ["rows.jsonl:2", "'chosen' and 'rejected' are missing"], "sft": ["rows.jsonl:2", "'output'"]}),
    Case("same-completions", [OWN, {"prompt": "x", "chosen": "a", "rejected": "a"}],
         {"dpo": ["rows.jsonl:2", "chosen equals rejected"], "sft": ["rows.jsonl:2", "'instruction' is missing"]}),
    Case("empty-completion", [OWN, {"prompt": "x", "chosen": " ", "rejected": "b"}],
         {"dpo": ["rows.jsonl:2", "'chosen' has no reply"]}),
    Case("malformed-json", [OWN, "{oops\n"], {o: ["rows.jsonl:2", "malformed JSON"] for o in NAMES}),
    Case("not-an-object", [OWN, "[1, 2]\n"], {o: ["rows.jsonl:2", "not an object"] for o in NAMES}),
    Case("empty-file", [], {o: ["rows.jsonl", "no usable row"] for o in NAMES}),
    Case("every-row-skipped", ["{oops\n"], {o: ["rows.jsonl", "no usable row", "malformed JSON"] for o in NAMES},
         data={"on_bad_row": "skip"}),
    Case("missing-file", [], {o: ["data.path", "absent.jsonl", "does not exist"] for o in NAMES},
         data={"path": "{tmp}/absent.jsonl"}),
    Case("builtin-sft-task", [], {"dpo": ["builtin:dates:row 0", "'chosen' and 'rejected' are missing"]},
         data={"path": "builtin:dates"}),
    Case("format-chat", [OWN], {"dpo": ["data.format is chat"], "sft": ["rows.jsonl:1", "'conversations'"]},
         data={"format": "chat"}),
    Case("format-preference", [OWN], {"sft": ["data.format is preference"]}, data={"format": "preference"}),
    Case("eval-lacks-a-field", [OWN, OWN], eval_rows=[LACKS_REJECTED],
         expect={"dpo": ["eval.jsonl:1", "'rejected' is missing"], "sft": ["eval.jsonl:1", "cannot tell"]}),
]
TABLE = [pytest.param(case, objective, id=f"{case.id}-{objective}") for case in CASES for objective in case.expect]


def _rows(rows: list, objective: str) -> list:
    return [GOOD[objective] if row == OWN else row for row in rows]


def _data(case: Case, objective: str, tmp_path: Path) -> dict[str, str]:
    """data.* settings: the table's, with data.path (and data.eval_path) written under tmp_path."""
    data = {key: value.replace("{tmp}", str(tmp_path)) for key, value in case.data.items()}
    if "path" not in data:
        data["path"] = str(write_jsonl(tmp_path / "rows.jsonl", _rows(case.rows, objective)))
    if case.eval_rows is not None:
        data["eval_path"] = str(write_jsonl(tmp_path / "eval.jsonl", _rows(case.eval_rows, objective)))
    return data


def _names_its_objective(message: str, objective: str, needles: list[str]) -> None:
    own, other = NAMES[objective]
    for needle in [*needles, own]:
        assert needle in message, f"{needle!r} not in:\n{message}"
    assert other not in message, f"the other objective's {other!r} in:\n{message}"


@pytest.mark.parametrize(("case", "objective"), TABLE)
def test_prepare_names_the_objectives_shapes_and_the_row(tmp_path, tok, case, objective):
    data = DataConfig(**_data(case, objective, tmp_path))
    with pytest.raises(DataError) as err:
        prepare_datasets(data, tok, tmp_path / "cache", log=lambda _: None, objective=objective)
    _names_its_objective(str(err.value), objective, case.expect[objective])


@pytest.mark.parametrize(("case", "objective"), [p for p in TABLE if p.values[0].eval_rows is None])
def test_the_dry_run_names_the_objectives_shapes_and_the_row(tmp_path, case, objective):
    """The dry run reads the training rows only (eval rows are read by prepare, above)."""
    settings = [f"data.{key}={value}" for key, value in _data(case, objective, tmp_path).items()]
    result = run_cli("train", TINY, f"output_dir={tmp_path}/runs", f"train.objective={objective}", *settings,
                     "--dry-run", env=WIDE)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    _names_its_objective(result.stderr, objective, case.expect[objective])


@pytest.mark.parametrize(("objective", "rows"), [
    ("sft", [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]),
    ("dpo", [{"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", "content": "Hello"}],
              "rejected": [{"role": "assistant", "content": "Go"}]}]),
])
def test_conversations_without_a_chat_template_name_the_objectives_other_shapes(tmp_path, objective, rows):
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = None
    data = DataConfig(path=str(write_jsonl(tmp_path / "rows.jsonl", rows)))
    with pytest.raises(DataError, match="no chat template") as err:
        prepare_datasets(data, tokenizer, tmp_path / "cache", log=lambda _: None, objective=objective)
    _names_its_objective(str(err.value), objective, ["rows.jsonl:1"])


@pytest.mark.parametrize(("first", "then", "needles"), [
    ("sft", "dpo", ["rows.jsonl:1", "'chosen' and 'rejected' are missing"]),
    ("dpo", "sft", ["rows.jsonl:1", "preference pair"]),
])
def test_a_cache_the_other_objective_built_fails_at_its_first_row(tmp_path, tok, first, then, needles):
    """Same data and settings, so the same cache: the other objective still hears which row does not fit."""
    data = DataConfig(path=str(write_jsonl(tmp_path / "rows.jsonl", [{"text": "hello"}] if first == "sft" else [PAIR])))
    prepare_datasets(data, tok, tmp_path / "cache", log=lambda _: None, objective=first)
    with pytest.raises(DataError) as err:
        prepare_datasets(data, tok, tmp_path / "cache", log=lambda _: None, objective=then)
    _names_its_objective(str(err.value), then, needles)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
@pytest.mark.parametrize("damage", ["absent", "empty"])
def test_train_s_first_check_of_the_files_names_the_objectives_shapes(tmp_path, objective, damage):
    """`train` checks the data files before any process starts (preflight): its advice is the objective's too, and
    a built-in task (SFT rows) is never offered to a dpo job."""
    path = tmp_path / "rows.jsonl"
    if damage == "empty":
        path.write_text("")
    result = run_cli("train", TINY, f"output_dir={tmp_path}/runs", f"train.objective={objective}",
                     f"data.path={path}", env=WIDE)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    _names_its_objective(result.stderr, objective, ["data.path", "does not exist" if damage == "absent" else "empty"])
    assert ("builtin:dates" in result.stderr) == (objective == "sft"), result.stderr[-3000:]
