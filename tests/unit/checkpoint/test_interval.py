"""checkpoint.every_minutes: auto saves at the Young/Daly interval from the measured stall and the job's MTBF."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import TINY, assert_ok, events, trainyard
from trainyard.config_file import load_config
from trainyard.errors import ConfigError


def test_auto_derives_the_interval_from_the_measured_stall_and_saves_at_it(tmp_path: Path) -> None:
    """An MTBF of 3.6 ns makes the interval microseconds: after the first save every step saves."""
    result = trainyard(
        "train", TINY, f"output_dir={tmp_path}", "train.max_steps=6", "checkpoint.every_steps=2",
        "checkpoint.every_minutes=auto", "checkpoint.mtbf_hours=1e-12", "checkpoint.keep_last=10",
        "eval.every_steps=0", "eval.at_end=false", "log.progress=false", "log.tensorboard=false",
    )
    assert_ok(result)
    run_dir = tmp_path / "tiny"
    announced = [e for e in events(run_dir, "system") if e.get("event") == "checkpoint_interval"]
    assert announced, "no interval was derived"
    first = announced[0]
    assert first["step"] == 2 and first["nodes"] == 1
    assert first["minutes"] == pytest.approx(math.sqrt(2 * first["save_s"] * 1e-12 * 3600) / 60, rel=1e-2)
    saved = sorted(e["step"] for e in events(run_dir, "checkpoint") if e["mode"] == "full")
    assert saved == [2, 3, 4, 5, 6], "timed saves after every step once the interval is known"


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_every_minutes_takes_a_number_or_auto(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [f"checkpoint.every_minutes={value}"])
    assert "checkpoint.every_minutes" in err.value.render()
    assert load_config("tiny", ["checkpoint.every_minutes=auto"]).checkpoint.every_minutes == "auto"
