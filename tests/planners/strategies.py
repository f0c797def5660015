"""Hypothesis strategies for planner tests: small but arbitrary valid layouts."""

from __future__ import annotations

from hypothesis import strategies as st

from planners.layout import Layout, StageLayout


@st.composite
def layouts(
    draw: st.DrawFn,
    max_layers: int = 10,
    max_stages: int = 4,
    max_dp: int = 4,
    weighted: bool = True,
    zero_layout: str | None = None,
) -> Layout:
    """A valid layout: random boundaries, DP sizes, rank numbering, sample weights and numels."""
    num_layers = draw(st.integers(1, max_layers))
    num_stages = draw(st.integers(1, min(max_stages, num_layers)))
    cuts = (
        sorted(
            draw(st.sets(st.integers(1, num_layers - 1), min_size=num_stages - 1, max_size=num_stages - 1))
        )
        if num_stages > 1
        else []
    )
    edges = [0, *cuts, num_layers]
    dps = [draw(st.integers(1, max_dp)) for _ in range(num_stages)]
    rank_ids = draw(st.permutations(range(sum(dps) + 3)))[: sum(dps)]
    num_micro = draw(st.integers(1, 4))
    global_batch = draw(st.integers(num_micro, 24))
    stages, pos = [], 0
    for p, dp in enumerate(dps):
        ranks = tuple(rank_ids[pos : pos + dp])
        pos += dp
        weights: tuple[int, ...] = ()
        if weighted and draw(st.booleans()):
            weights = tuple(
                draw(st.lists(st.integers(0, 3), min_size=dp, max_size=dp).filter(lambda w: sum(w) > 0))
            )
        stages.append(StageLayout(p, edges[p], edges[p + 1], ranks, weights))
    numel = tuple(draw(st.lists(st.integers(0, 40), min_size=num_layers, max_size=num_layers)))
    kind = zero_layout or draw(st.sampled_from(["interleaved", "contiguous"]))
    return Layout(num_layers, global_batch, num_micro, tuple(stages), numel, kind)  # type: ignore[arg-type]
