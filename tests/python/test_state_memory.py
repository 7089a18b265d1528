"""The README's "Memory per parameter" table against what SimulatedWorkers keeps (gradzip.fsdp's
row: what a rank of two Gloo ranks keeps): every row's bytes per parameter of one rank's state, and
its backup where the non-finite guard keeps one."""

import re
from pathlib import Path

import pytest
import torch

import fsdp_adam_scenarios
import fsdp_scenarios
from dist_util import run_ranks
from gradzip.optim import CompressedSGD, FrozenVarianceAdamW
from gradzip.reducer import state_tensors
from gradzip.simulation import SimulatedWorkers

README = Path(__file__).resolve().parents[2] / "README.md"
WORLD, ROWS, COLS = 4, 200, 201  # one matrix of odd shape
R = 2  # ranks per node of the two-level rows


def table() -> dict:
    """The table's rows: configuration -> (state, with the guard's backup), as written."""
    text = README.read_text().split("\n## Memory per parameter", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:4] for line in text.splitlines() if line.startswith("| ")]
    return {c.strip(): (s.strip(), g.strip()) for c, s, g in rows[1:]}


def params():
    return [torch.nn.Parameter(torch.zeros(ROWS, COLS))]


# each row's SimulatedWorkers arguments (codec first)
SETTINGS = {
    "no error feedback": ("int8", dict(error_feedback=False)),
    "error feedback: fp16, bf16, int8, sign, top-k all-gathered": [
        ("fp16", {}), ("bf16", {}), ("int8", {}), ("sign", {}), ("topk:0.01", {})],
    "top-k two-phase": ("topk:0.01", dict(cast_sum="fp32")),
    "`FrozenVarianceAdamW`, top-k all-gathered": (
        "topk:0.01", dict(optimizer=lambda: FrozenVarianceAdamW(params()), warmup_steps=1)),
    "`FrozenVarianceAdamW`, sign": (
        "sign", dict(optimizer=lambda: FrozenVarianceAdamW(params()), warmup_steps=1)),
    "`CompressedSGD`, top-k": ("topk:0.01", dict(optimizer=lambda: CompressedSGD(params()))),
    "`lowrank:R`": ("lowrank:2", {}),
    "`gradzip.fsdp` with `FrozenVarianceAdamW`": "fsdp",
    "compact residual (`residual_dtype=torch.bfloat16`)": [
        (codec, dict(residual_dtype=torch.bfloat16))
        for codec in ("fp16", "bf16", "int8", "sign", "topk:0.01")],
    "compact residual, top-k two-phase": (
        "topk:0.01", dict(cast_sum="fp32", residual_dtype=torch.bfloat16)),
    "two-level reduction": [(codec, dict(ranks_per_node=R))
                            for codec in ("fp16", "bf16", "int8", "sign", "topk:0.01")],
    "compact residual, `FrozenVarianceAdamW`, sign": (
        "sign", dict(optimizer=lambda: FrozenVarianceAdamW(params()), warmup_steps=1,
                     residual_dtype=torch.bfloat16)),
}
FSDP_WORLD = 2  # ROWS is a multiple: FSDP pads nothing


def measured(codec: str, kwargs: dict, guard: bool) -> tuple:
    """Bytes per parameter of rank 0's state after three steps, and its Q factors' share."""
    kwargs = {k: v() if callable(v) else v for k, v in kwargs.items()}
    sim = SimulatedWorkers(codec, WORLD, min_compress_numel=0, guard_nonfinite=guard, **kwargs)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        sim.reduce([torch.randn(ROWS * COLS, generator=g) for _ in range(WORLD)],
                   shapes=[(ROWS, COLS)])
    rank0 = sim._shards[0] if sim._shards else sim  # two-level: rank 0 is local rank 0 of node 0
    buckets = rank0._ef[0].buckets.values()
    kept = [t for st in buckets for t in state_tensors(st) if t is not None]
    q = sum(t.numel() * t.element_size() for st in buckets
            for t in ([st.q] if torch.is_tensor(st.q) else list(st.q or [])))
    state = sum(t.numel() * t.element_size() for t in kept) / (ROWS * COLS)
    return state, q / (ROWS * COLS), rank0._guards[0] is not None


def expected(cell: str, q: float, world: int = WORLD) -> float:
    """A cell of the table (e.g. "8 + 8/W", "4 + Q", "8 + 2Q") at this test's W and Q."""
    expr = re.sub(r"(\d)Q", r"\1*Q", cell)
    return eval(expr, {"W": world, "Q": q, "R": R})  # the table's arithmetic, nothing else


def row_of(config: str) -> tuple:
    matches = [v for k, v in table().items() if k.startswith(config)]
    assert len(matches) == 1, f"README.md has no single row starting {config!r}"
    return matches[0]


def measured_fsdp(tmp_path) -> tuple:
    """Bytes per parameter of rank 0's state after the freeze under FSDP, and those of the
    tensors the guard backs up at a compressed step (the residuals, m and m over the denominator;
    v and the denominator do not change)."""
    run_ranks(fsdp_scenarios.session, FSDP_WORLD, str(tmp_path),
              [(fsdp_adam_scenarios.memory, (ROWS, COLS))])
    kept = fsdp_scenarios.load(tmp_path, "memory", FSDP_WORLD)[0]
    backed_up = ("residual", "owner_residual", "m", "m_over_den")
    return sum(kept.values()) / (ROWS * COLS), sum(kept[k] for k in backed_up) / (ROWS * COLS)


def test_the_fsdp_row_states_what_a_rank_keeps(tmp_path):
    state_cell, guarded_cell = row_of("`gradzip.fsdp` with `FrozenVarianceAdamW`")
    state, backup = measured_fsdp(tmp_path)
    assert state == pytest.approx(expected(state_cell, 0.0, FSDP_WORLD))
    assert state + backup == pytest.approx(expected(guarded_cell, 0.0, FSDP_WORLD))


@pytest.mark.parametrize("config", [c for c, s in SETTINGS.items() if s != "fsdp"])
def test_the_table_states_what_a_rank_keeps(config):
    state_cell, guarded_cell = row_of(config)
    runs = SETTINGS[config] if isinstance(SETTINGS[config], list) else [SETTINGS[config]]
    for codec, kwargs in runs:
        state, q, _ = measured(codec, kwargs, guard=False)
        assert state == pytest.approx(expected(state_cell, q)), (codec, state)
        state, q, has_guard = measured(codec, kwargs, guard=True)
        backup = state if has_guard else 0.0  # the guard backs up every state tensor it protects
        assert state + backup == pytest.approx(expected(guarded_cell, q)), (codec, state)


def test_every_row_is_checked():
    assert all(any(c.startswith(k) for k in SETTINGS) for c in table())
