"""plan.png: readable for a small model on this machine (bars far below capacity, tiny stages)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from neorec.config.load import load_config  # noqa: E402
from neorec.planner.report import plan_figure  # noqa: E402
from neorec.train.run_plan import cluster_for_run, plan_command  # noqa: E402


def test_legends_outside_bars_labelled_axes_and_small_values_readable():
    cfg = load_config("default", ["data.synthetic.max_rows=500", "data.batch_size=256"])
    out = plan_command(cfg, "this", 2, baselines=True, batches=1, time_budget=1.0)
    fig = plan_figure(out.results, cluster_for_run(cfg, 2))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        rows = [fig.axes[: len(out.results)], fig.axes[len(out.results) :]]
        for row in rows:
            legends = [a.get_legend() for a in row if a.get_legend() is not None]
            assert len(legends) == 1  # one per row
            box = legends[0].get_window_extent(renderer)
            for a in row:  # right of every plan's bars
                assert box.x0 >= a.get_window_extent(renderer).x1
            for a in row:
                assert a.get_xlabel() == "rank" and a.get_ylabel()
        labels = [t.get_text() for t in rows[0][-1].get_legend().get_texts()]
        assert any(t.startswith("ids (up to ") and t.endswith(" ms)") for t in labels), labels
        # the report's step estimate (each phase's slowest rank) can exceed every rank's bar: drawn
        step = out.results[-1].estimate.step_time * 1e3
        assert f"step estimate {step:.2f} ms (slowest rank in each phase)" in labels, labels
        memory_labels = [t.get_text() for t in rows[1][-1].get_legend().get_texts()]
        # the model's few MB are drawn on their own scale, the capacity named instead of drawn
        assert any("off the scale" in t for t in memory_labels), memory_labels
        top = max(p.get_height() for p in rows[1][0].patches)
        assert top > 0.5 * rows[1][0].get_ylim()[1]
    finally:
        plt.close(fig)


def test_a_plan_far_below_the_others_gets_its_own_scale():
    """Beside baselines 50x slower (the 12T dry run), the planner's bars were a line at the bottom."""
    cfg = load_config("default", ["data.synthetic.max_rows=500", "data.batch_size=256"])
    out = plan_command(cfg, "this", 2, baselines=True, batches=1, time_budget=1.0)
    planner, *baselines = out.results
    for r in planner.estimate.ranks:  # the planner's plan, made 10x cheaper than any baseline
        r.stages = {s: v / (10 * max(b.estimate.step_time for b in baselines) / planner.estimate.step_time)
                    for s, v in r.stages.items()}  # fmt: skip
    planner.bound = None
    fig = plan_figure(out.results, cluster_for_run(cfg, 2))
    try:
        titles = [a.get_title() for a in fig.axes[: len(out.results)]]
        assert titles[0].endswith(", own scale)") and not any("own scale" in t for t in titles[1:]), titles
        top = max(p.get_y() + p.get_height() for p in fig.axes[0].patches)
        assert top > 0.5 * fig.axes[0].get_ylim()[1]
    finally:
        plt.close(fig)
