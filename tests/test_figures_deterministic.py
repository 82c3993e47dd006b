"""Every figure and sidecar the notebooks export is byte-identical from one run to the next: the
notebook tests' smoke run of each group is compared, file by file, with a second run in other
kernel processes (the browser test's JupyterLab run of a notebook where it ran on this worker,
else a second papermill run)."""

import pytest
from conftest import NOTEBOOK_GROUPS, notebook_group, run_notebooks_smoke, second_run_exports

EXPORTED = (".png", ".svg", ".json")


def _exports(folder, number: str) -> dict:
    return {
        p.name: p.read_bytes() for p in folder.iterdir() if p.name.startswith(f"{number}_") and p.suffix in EXPORTED
    }


# each group on the test worker that runs its notebook tests (conftest.notebook_group), after the
# browser test's runs of its notebooks there (test_browser.py is collected first)
@pytest.mark.parametrize("only", [pytest.param(g, marks=notebook_group(g)) for g in NOTEBOOK_GROUPS])
def test_two_runs_export_the_same_figure_bytes(tmp_path_factory, tiny_checkpoint, only):
    first, _ = run_notebooks_smoke(tmp_path_factory, tiny_checkpoint, only)
    for number, folder in second_run_exports(tmp_path_factory, tiny_checkpoint, only).items():
        assert folder != first
        a, b = _exports(first, number), _exports(folder, number)
        figures = sorted(n for n in a if not n.endswith(".json"))
        assert figures, f"notebook {number} exported no figure"
        assert sorted(a) == sorted(b), f"notebook {number}: the two runs exported different files"
        differ = [name for name in sorted(a) if a[name] != b[name]]
        assert differ == [], f"notebook {number}: these exports differ between two runs: {differ}"
