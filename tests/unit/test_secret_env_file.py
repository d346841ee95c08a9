"""``trainpod submit --secret-env-file``: KEY=VALUE lines; a bad line is named, never shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpod.cli.jobs import parse_env, read_env_file
from trainpod.errors import SpecError


def test_lines_comments_and_values_as_written(tmp_path: Path) -> None:
    f = tmp_path / "s.env"
    f.write_text("# keys\n\nHF_TOKEN=hf_x=y\n  WANDB_API_KEY='q'\n")
    assert read_env_file(f) == {"HF_TOKEN": "hf_x=y", "WANDB_API_KEY": "'q'"}


def test_a_bad_line_is_named_by_number_without_its_content(tmp_path: Path) -> None:
    f = tmp_path / "s.env"
    f.write_text("A=1\nsk_live_no_equals_sign\n")
    with pytest.raises(SpecError) as info:
        read_env_file(f)
    assert "line 2 is not KEY=VALUE" in str(info.value)
    assert "sk_live" not in str(info.value)


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read it"):
        read_env_file(tmp_path / "absent.env")


def test_a_bad_secret_pair_is_not_echoed() -> None:
    with pytest.raises(SpecError) as info:
        parse_env(["sk_live_oops"], "--secret-env")
    assert "--secret-env expects KEY=VALUE" in str(info.value)
    assert "sk_live" not in str(info.value)
