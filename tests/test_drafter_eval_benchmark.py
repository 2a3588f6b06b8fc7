"""benchmarks/drafter_eval.py: its plot draws every compared method per domain."""

import pytest
from bench_loader import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("drafter_eval") as module:
        yield module


def _results(methods):
    return {d: {"methods": {m: {"mean_tau": 1.5 + i, "speedup": 0.9 + i / 10} for i, m in enumerate(methods)}}
            for d in ("code", "math", "prose", "humaneval")}


@pytest.mark.parametrize("methods", [["spec"], ["spec", "tree16", "tree_auto"]])
def test_plot_draws_a_bar_per_method_and_domain(bench, methods, tmp_path, monkeypatch):
    import matplotlib.axes

    bars = []
    real = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda self, x, height, *a, **k: bars.append(list(height)) or real(self, x, height, *a, **k))
    path = tmp_path / "eval.png"
    bench.plot(_results(methods), str(path), "title")
    assert path.stat().st_size > 0
    assert len(bars) == 2 * len(methods)  # τ and speedup panels
    assert bars[0] == [1.5] * 4 and bars[-1] == [pytest.approx(0.9 + (len(methods) - 1) / 10)] * 4
