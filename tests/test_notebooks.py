"""`dsv41 notebooks`: the papermill runner on throwaway notebooks, and (slow) notebooks 01 and 02 in
smoke mode with assertions on the numbers their sidecars carry."""

import json
from pathlib import Path

import nbformat
import pytest
from conftest import notebook_group, run_notebooks_smoke, sidecar, write_throwaway_notebook

from dsv41.app import notebooks as runner
from dsv41.app.cli import main as dsv41_main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def notebook_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("nbs")
    # 01 fails in its third code cell; 02 runs after it and exports a figure; 03 breaks the contract
    write_throwaway_notebook(d / "01_fails.ipynb", "x = 1", "y = 2", "z = x / (y - 2)  # boom", "never = True")
    write_throwaway_notebook(
        d / "02_plots.ipynb",
        "import os, sys\nfrom dsv41.observe import viz",
        "fig, ax = viz.new_figure()\nax.plot([0, 1, 2], [0, 1, 4])\nviz.show(fig)",
        "paths = viz.export_figure(fig, '02_square', output_dir, {'x': [0, 1, 2], 'y': [0, 1, 4], "
        "'smoke': smoke, 'prompt': prompt, 'checkpoint': checkpoint, 'headless': viz.is_headless(), "
        "'python': sys.executable})",
    )
    write_throwaway_notebook(d / "03_two_parameter_cells.ipynb", "pass", n_parameter_cells=2)
    (d / "notes.ipynb").write_text("not numbered, never run")
    return d


@pytest.fixture(scope="module")
def first_run(notebook_dir, tmp_path_factory):
    out_root = tmp_path_factory.mktemp("outputs")
    code = dsv41_main(
        [
            "notebooks",
            "--notebooks",
            str(notebook_dir),
            "--outputs-root",
            str(out_root),
            "-p",
            "smoke",
            "true",
            "-p",
            "prompt",
            "hello there",
        ]
    )
    return code, out_root


def test_failing_notebook_is_reported_and_the_others_still_run(first_run):
    code, out_root = first_run
    assert code == 1
    run = out_root / "run-001"
    summary = json.loads((run / "summary.json").read_text())
    assert [n["name"] for n in summary["notebooks"]] == ["01_fails", "02_plots", "03_two_parameter_cells"]
    assert summary["ok"] is False and summary["n_ok"] == 1 and summary["n_failed"] == 2
    fails, plots, two = summary["notebooks"]
    assert fails["status"] == "failed"
    # source cells: 0 markdown, 1 parameters, 2 "x = 1", 3 "y = 2", 4 the division
    assert fails["failed_cell"] == 4
    # the executed file has papermill's error banner, its parameters cell and an error anchor before it
    assert fails["failed_cell_executed"] == 7
    assert fails["failed_cell_source"] == "z = x / (y - 2)  # boom"
    assert fails["error"].startswith("ZeroDivisionError")
    assert (run / "01_fails.ipynb").is_file()  # the executed notebook is kept, with the traceback
    assert plots["status"] == "ok" and plots["error"] is None and plots["duration_s"] > 0
    assert two["status"] == "failed" and "2 cells tagged 'parameters'" in two["error"]


def test_parameters_pass_through_and_figures_land_in_the_run(first_run):
    _, out_root = first_run
    run = out_root / "run-001"
    summary = json.loads((run / "summary.json").read_text())
    plots = summary["notebooks"][1]
    assert sorted(plots["outputs"]) == ["02_square.json", "02_square.png", "02_square.svg"]
    sidecar = json.loads((run / "02_square.json").read_text())
    assert sidecar["smoke"] is True  # "true" parsed as JSON
    assert sidecar["prompt"] == "hello there"  # not JSON: passed as text
    assert sidecar["checkpoint"] is None  # no --checkpoint: the notebook's own default stays
    assert sidecar["headless"] is True
    assert sidecar["y"] == [0, 1, 4]
    assert summary["parameters"]["output_dir"] == str(run.resolve())
    executed = nbformat.read(str(run / "02_plots.ipynb"), as_version=4)
    images = [
        o
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]
    assert images, "viz.show left no static figure in the executed notebook"


def test_runs_are_numbered_and_never_overwritten(first_run, notebook_dir):
    _, out_root = first_run
    first = out_root / "run-001"
    before = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}
    code = dsv41_main(["notebooks", "--notebooks", str(notebook_dir), "--outputs-root", str(out_root), "--only", "02"])
    assert code == 0
    second = json.loads((out_root / "run-002" / "summary.json").read_text())
    assert [n["name"] for n in second["notebooks"]] == ["02_plots"] and second["ok"] is True
    assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before
    # an explicit --out that holds an earlier run is refused, and left as it was
    assert dsv41_main(["notebooks", "--notebooks", str(notebook_dir), "--out", str(first)]) == 2
    assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before


def test_bad_usage_exits_2(notebook_dir, tmp_path, capsys):
    base = ["notebooks", "--notebooks", str(notebook_dir), "--outputs-root", str(tmp_path)]
    assert dsv41_main(base + ["--only", "99"]) == 2
    assert "no such notebook" in capsys.readouterr().err
    assert dsv41_main(base + ["-p", "promt", "x"]) == 2
    assert "no notebook declares" in capsys.readouterr().err
    assert dsv41_main(base + ["-p", "output_dir", "x"]) == 2
    assert dsv41_main(["notebooks", "--notebooks", str(tmp_path / "missing")]) == 2
    assert not any(tmp_path.iterdir()), "a refused run still created a folder"


def test_missing_kernel_is_one_sentence(notebook_dir, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ipykernel" else real(name, *a))
    assert dsv41_main(["notebooks", "--notebooks", str(notebook_dir), "--outputs-root", str(tmp_path)]) == 2
    assert "ipykernel is not installed" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "a run folder was created although no kernel can start"


def test_selection_and_values():
    value = runner.parse_value
    assert value("n", "3") == 3 and value("n", "true") is True
    assert value("n", "null") is None and value("n", "[1, 2]") == [1, 2]
    assert value("n", "hello") == "hello" and value("n", '"7"') == "7"
    # Python's spellings of the literals; the text parameters stay text whatever they look like
    assert value("n", "False") is False and value("n", "True") is True and value("n", "None") is None
    assert value("prompt", "42") == "42" and value("device", "null") == "null"


@pytest.mark.parametrize("text, want", [("false", False), ("False", False), ("true", True), ("True", True)])
def test_smoke_takes_a_boolean_in_either_spelling(text, want):
    """`-p smoke False` passed the string "False", which is truthy: smoke mode went on."""
    assert runner.parse_value("smoke", text) is want


@pytest.mark.parametrize("text", ["no", "0", "1", "off", '"false"', "[]"])
def test_smoke_refuses_what_is_not_a_boolean(notebook_dir, tmp_path, capsys, text):
    code = dsv41_main(
        ["notebooks", "--notebooks", str(notebook_dir), "--outputs-root", str(tmp_path), "-p", "smoke", text]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"-p smoke takes true or false, got {text!r}" in err, err
    assert not any(tmp_path.iterdir())


def test_selection_by_prefix(notebook_dir):
    names = [p.stem for p in runner.find_notebooks(notebook_dir, ["02", "01_fails"])]
    assert names == ["01_fails", "02_plots"]
    assert [p.stem for p in runner.find_notebooks(notebook_dir)] == ["01_fails", "02_plots", "03_two_parameter_cells"]


# ---------------------------------------------------------------------- the real notebooks
def test_every_notebook_has_one_parameters_cell_and_no_outputs():
    found = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert found, "no notebooks in notebooks/"
    for path in found:
        assert runner.parameters_cell_problem(path) is None
        assert set(runner.STANDARD_PARAMETERS) <= runner.declared_parameters(path), path.name
        nb = nbformat.read(str(path), as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: committed outputs"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_checkpoint):
    """Notebooks 01 and 02 executed in smoke mode on the session's tiny checkpoint (the embedded
    default, written into a pytest temp folder, never the user cache), once for these tests."""
    return run_notebooks_smoke(tmp_path_factory, tiny_checkpoint, SMOKE_NOTEBOOKS)[0]


SMOKE_NOTEBOOKS = "01,02"
pytestmark = notebook_group(SMOKE_NOTEBOOKS)


_sidecar = sidecar


@pytest.mark.slow
def test_audit_notebook_numbers(smoke_run):
    facts = _sidecar(smoke_run, "01_audit_facts")
    tiny = facts["tiny"]
    assert tiny["exit_code"] == 0 and tiny["failed"] == 0 and tiny["undecided"] == 0
    assert tiny["passed"] == tiny["checks"] >= 39 and tiny["tensors"] == tiny["expected_tensors"]
    for name, layouts in facts["config"].items():
        assert layouts["flat file from nested"] and layouts["flat file from flat"], name
        assert layouts["nested round trip"] and layouts["verify problems"] == [], name
        assert layouts["dtype (quantization)"] == "fp8" and layouts["param_dtype (storage)"] == "bfloat16"
    # the released pair differs exactly by the fields only the nested (Transformers) file states
    assert sorted(line.split(":")[0] for line in facts["config"]["released"]["differs"]) == sorted(
        [
            "model_type",
            "architectures",
            "param_dtype",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "hidden_act",
            "max_position_embeddings",
            "num_key_value_heads",
            "tie_word_embeddings",
            "topk_method",
            "norm_topk_prob",
        ]
    )

    released = facts["released"]
    assert (released["tensors"], released["bytes"], released["shards"]) == (96_085, 510_286_023_000, 48)
    assert released["exit_code"] == 0 and released["failed"] == released["undecided"] == 0
    assert released["categories"]["routed experts"]["tensors"] == 94_464
    assert released["categories"]["Engram"]["tensors"] == 12
    assert sum(c["bytes"] for c in released["categories"].values()) == 510_286_023_000
    assert released["layer_modes"]["full"] == [2, 8, 14, 20]
    assert released["layer_modes"]["reindex"] == [24, 28, 32, 36]

    bars = _sidecar(smoke_run, "01_bytes_by_category")
    assert (bars["total_tensors"], bars["total_bytes"]) == (96_085, 510_286_023_000)
    assert bars["bytes"] == bars["expected_bytes"] and sum(bars["bytes"]) == bars["total_bytes"]
    modes = _sidecar(smoke_run, "01_layer_modes")
    assert modes["modes_from_headers"] == modes["modes_from_config"] and len(modes["modes_from_config"]) == 40

    partial = facts["partial"]
    on_disk = set(partial["shards_on_disk"])
    assert on_disk == set(range(1, 21)) | {44}
    assert partial["failed"] == 0 and partial["exit_code"] == 0 and partial["undecided"]
    for check, waits in partial["undecided"].items():
        assert waits and not on_disk & set(waits), check  # waits only on shards that are not there
    assert partial["undecided"]["engram.dtype"] == [47, 48]  # the Engram tables' shards
    assert _sidecar(smoke_run, "01_partial_download")["undecided"] == partial["undecided"]

    negative = facts["negative_control"]
    assert negative["engram_n_heads"] == 7 and negative["exit_code"] == 1
    assert "engram.rows" in negative["failed"] and "384006168" in negative["failed"]["engram.rows"]


@pytest.mark.slow
def test_engram_notebook_numbers(smoke_run):
    layout = _sidecar(smoke_run, "02_prime_layout")
    assert layout["derived_rows"] == [384_006_168, 384_016_682]
    assert layout["declared_rows"] == layout["derived_rows"] and layout["problems"] == []
    assert (layout["primes"][0][0], layout["primes"][0][-1]) == (16_000_057, 16_000_463)
    assert (layout["primes"][1][0], layout["primes"][1][-1]) == (16_000_477, 16_000_889)
    for row, starts in zip(layout["primes"], layout["offsets"]):  # buckets tile each table
        assert starts == [sum(row[:c]) for c in range(len(row))]

    facts = _sidecar(smoke_run, "02_engram_facts")
    assert facts["smoke"] is True
    # the Engram report finds no problem in the released layout nor in this checkpoint's
    assert facts["layout"]["released"]["problems"] == [] and facts["layout"]["checkpoint"]["problems"] == []
    assert facts["multipliers"]["released"] == {
        "1": [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        "14": [67716810739261, 51510806800915, 30921347202721, 82619226485591],
    }
    assert facts["folding"]["Café"] == facts["folding"]["cafe"] == "cafe"
    assert facts["folding"][" HELLO"] == "hello" and facts["folding"][" "] == " "
    tok = facts["tokenizer"]
    assert tok["compressed_size"] == tok["config_compressed_size"] < tok["n_ids"]
    assert facts["split"]["n_splits"] == len(facts["prompt"]["token_ids"]) - 1 > 5
    assert all(facts["split"]["equal"]) and facts["split"]["matches_report"]
    assert facts["prompt"]["inside_tables"] is True and facts["prompt"]["problems"] == []

    hashes = _sidecar(smoke_run, "02_prompt_hash_ids")
    assert all(0 <= w < 1 for pos in hashes["within_bucket"] for layer in pos for w in layer)
    for pos in hashes["hash_ids"]:
        for k, layer in enumerate(pos):
            assert all(0 <= h < hashes["num_embeddings"][k] for h in layer)


@pytest.mark.slow
def test_engram_notebook_dead_tokens_and_load(smoke_run):
    dead = _sidecar(smoke_run, "02_dead_tokens")
    j = dead["dead_at"]
    # (position t, n-gram size n) changes exactly when the n-gram ending at t reaches back to j
    expected = [[t - (n - 1) <= j <= t for n in dead["ngram_sizes"]] for t in range(dead["n_positions"])]
    assert dead["changed"] == expected

    load = _sidecar(smoke_run, "02_bucket_load")
    assert load["inside_buckets"] is True
    n_cols = 6  # tiny: (max_ngram_size 4 - 1) x 2 heads
    assert [e["layer"] for e in load["layers"]] == load["layer_ids"] == [1, 2]
    for e in load["layers"]:
        hist = e["histogram"]
        assert e["outside"] == 0 and e["positions"] == load["n_positions"]
        assert sum(hist) == e["rows"]  # every bucket row counted once
        assert sum(n * rows for n, rows in enumerate(hist)) == load["n_positions"] * n_cols
        assert e["rows_used"] == e["rows"] - hist[0] and e["max_load"] == max(n for n, r in enumerate(hist) if r)
        # the Poisson curve counts the same rows and positions (its tail past the plot is negligible)
        assert sum(e["poisson"]) == pytest.approx(e["rows"], rel=1e-6)
        assert sum(n * r for n, r in enumerate(e["poisson"])) == pytest.approx(load["n_positions"] * n_cols, rel=1e-6)
