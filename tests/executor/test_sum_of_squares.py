"""The gradient-clipping norm's sum of squares (`executor.zero.sum_of_squares`).

Each rank adds the squares of the reduced slices it owns and the ranks' sums are added in rank
order, so the norm, and with it every clipped step, must not depend on where a layout cuts the
gradient. These tests pin that down against exact arithmetic, on tensors that span several of
the host path's chunks.
"""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import pairwise

import pytest
import torch

from executor.zero import SQUARES_CHUNK, sum_of_squares

# fp64 round-off of ~10^5 additions is ~1e-14: far below the 6e-8 at which an fp32 clipping
# coefficient would notice. A sum that squares or adds in fp32 is off by 1e-8 or more, 10^4 times
# this tolerance.
REL_TOL = Fraction(1, 10**12)


def exact_sum_of_squares(t: torch.Tensor) -> Fraction:
    return sum((Fraction(float(x)) ** 2 for x in t.tolist()), Fraction(0))


@pytest.mark.parametrize(
    "numel", [0, 1, SQUARES_CHUNK - 1, SQUARES_CHUNK, SQUARES_CHUNK + 1, 3 * SQUARES_CHUNK + 7]
)
def test_matches_the_exact_sum_to_double_round_off(numel: int) -> None:
    t = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3.0
    want = exact_sum_of_squares(t)
    got = sum_of_squares(t)
    assert abs(Fraction(got) - want) <= REL_TOL * max(want, Fraction(1))


def test_squares_are_exact_where_fp32_would_round_them() -> None:
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 needs 25 significant bits: fp32 rounds it, fp64 does not,
    # and n such squares add exactly in fp64 (n < 2^18). A sum that squared in fp32 is off by n * 2^-24.
    x = 1.0 + 2.0**-12
    n = 2 * SQUARES_CHUNK + 5
    t = torch.full((n,), x, dtype=torch.float32)
    assert sum_of_squares(t) == n * (1.0 + 2.0**-11 + 2.0**-24)


def test_the_sum_does_not_depend_on_where_a_layout_cuts_the_slice() -> None:
    t = torch.randn(4 * SQUARES_CHUNK + 123, generator=torch.Generator().manual_seed(7))
    whole = sum_of_squares(t)
    for cuts in ([SQUARES_CHUNK // 3], [1, 2 * SQUARES_CHUNK + 9], [5_000, 77_777, 190_001]):
        bounds = [0, *cuts, t.numel()]
        parts = [sum_of_squares(t[a:b]) for a, b in pairwise(bounds)]
        assert math.isclose(math.fsum(parts), whole, rel_tol=float(REL_TOL), abs_tol=0.0), cuts


def test_a_non_contiguous_slice_and_a_float64_tensor() -> None:
    base = torch.randn(2 * SQUARES_CHUNK + 3, 2, generator=torch.Generator().manual_seed(3))
    strided = base[:, 1]
    assert not strided.is_contiguous()
    want = exact_sum_of_squares(strided)
    assert abs(Fraction(sum_of_squares(strided)) - want) <= REL_TOL * want
    wide = strided.double()
    assert abs(Fraction(sum_of_squares(wide)) - want) <= REL_TOL * want
