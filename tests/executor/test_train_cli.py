from __future__ import annotations

import pytest

from elaswave.cli import main


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_train_command_matches_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--pp", "2", "--dp", "1", "--steps", "3", "--move-at", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2]
    assert all(float(r[3]) < 1e-5 for r in rows)
    assert "blocking migration of ((1, 0, 1),)" in out


def test_train_command_rejects_impossible_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--pp", "5", "--layers", "4"]) == 2
    assert "error:" in capsys.readouterr().out
    assert main(["train", "--pp", "1", "--move-at", "1"]) == 2
