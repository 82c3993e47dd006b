"""Every figure the notebooks export is byte-identical from one run to the next: each smoke run
below executes the notebooks in fresh kernel processes, and the second run of each group is
compared, file by file, with the run the notebook tests use."""

import pytest

from conftest import notebook_group, run_notebooks_smoke

# the groups and thread settings the notebook tests run them with, so the first runs are shared
GROUPS = [("01,02", None), ("03,04", None), ("05", 1), ("06", 1)]


# each group on the test worker that runs its notebook tests (conftest.notebook_group)
@pytest.mark.parametrize("only, threads", [pytest.param(*g, marks=notebook_group(g[0])) for g in GROUPS])
def test_two_runs_export_the_same_figure_bytes(tmp_path_factory, tiny_checkpoint, only, threads):
    first, _ = run_notebooks_smoke(tmp_path_factory, tiny_checkpoint, only, threads)
    second, _ = run_notebooks_smoke(tmp_path_factory, tiny_checkpoint, only, threads, fresh=True)
    assert first != second
    figures = sorted(p.name for p in first.iterdir() if p.suffix in (".png", ".svg"))
    assert figures and figures == sorted(p.name for p in second.iterdir() if p.suffix in (".png", ".svg"))
    differ = [name for name in figures if (first / name).read_bytes() != (second / name).read_bytes()]
    assert differ == [], f"these exported figures differ between two runs: {differ}"
    sidecars = sorted(p.name for p in first.iterdir() if p.suffix == ".json" and p.name != "summary.json")
    assert [n for n in sidecars if (first / n).read_bytes() != (second / n).read_bytes()] == []
