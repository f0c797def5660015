"""`bench.clip_norm` runs, checks that both sums agree, and refuses bad sizes."""

from __future__ import annotations

import pytest

from bench import clip_norm
from executor.zero import SQUARES_CHUNK


def test_it_times_both_sums_on_slices_around_a_piece(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = [SQUARES_CHUNK // 2, 3 * SQUARES_CHUNK + 1]
    assert clip_norm.main(["--elements", *map(str, sizes), "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == sorted(sizes, reverse=True)
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)


def test_a_sum_that_disagrees_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clip_norm, "sum_of_squares", lambda t: float(t.float().pow(2).sum()))
    with pytest.raises(RuntimeError, match="disagree"):
        clip_norm.measure(3 * SQUARES_CHUNK, 1)


def test_a_size_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        clip_norm.main(["--elements", "0"])
    assert exc.value.code == 2
    assert "--elements must be positive" in capsys.readouterr().err
