"""The benchmark code's share of the non-test lines (scripts/bench_share.py) does not grow: it may
only come down, towards the 15% target. Lower CEILING as code leaves; raise it only for a
benchmark an issue asks for, saying which, after the one-off scripts have gone."""

from __future__ import annotations

from helpers import benchmark_script

# Set at 22% (the share was 21.7%); raised to 23% for `onegpu bench train --objective kto|reward`
# beside TRL (issue 56's target), after the export and mismatch one-offs went (share then 22.2%);
# lowered to 20% when the one-off scripts without a rerun left, bench_infer.py became `onegpu bench
# infer --preset hf-cpu|hf-gpu` and TRL's DPO, KTO and reward peers one runner and one report page
# (share then 19.7%); lowered to 18.5% when vlm_shapes, plan_vs_published and the tool rollouts'
# A/B left (measured once) and simgpu_fp8_memory folded into simgpu_memory --fp8 (share then
# 18.0%); lowered to 17.6% when policy_ab left (measured once), the training pages shared one
# opening (provenance.py's header), headline, table and footer, and the peer arms one setup and
# evidence (share then 17.6%); raised to 17.9% for issue 56's reward-model accuracy target
# (reward_accuracy.py) and the calculator curves, whose page script (grpo_tool_rollouts.py
# --curve) stays (share then 17.9%). The target is 15%.
CEILING = 0.179


def test_the_benchmark_share_stays_under_its_ceiling():
    script = benchmark_script("bench_share", folder="scripts")
    bench, total = script.share(script.lines_by_file())
    assert bench / total <= CEILING, (
        f"benchmark code is {bench / total:.1%} of the non-test lines ({bench:,} of {total:,}), "
        f"over its ceiling of {CEILING:.1%} (target {script.TARGET:.0%}): fold a new benchmark "
        "into an existing script, or delete a one-off one (its results file keeps its command "
        "and commit)"
    )


def test_the_count_splits_bench_from_the_rest(tmp_path):
    """Benchmark lines are src/onegpu/bench/ and benchmarks/; tests/ is in neither count."""
    script = benchmark_script("bench_share", folder="scripts")
    files = {
        "src/onegpu/bench/a.py": 3,
        "src/onegpu/infer/b.py": 5,
        "benchmarks/c.py": 2,
        "scripts/d.py": 1,
        "tests/e.py": 50,
    }
    for rel, n in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n" * n)
    counts = script.lines_by_file(tmp_path)
    assert "tests/e.py" not in counts
    assert script.share(counts) == (5, 11)
