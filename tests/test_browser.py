"""The notebooks in a real browser: JupyterLab started on a temporary copy of notebooks/, driven by
Playwright with the system Chromium (/usr/bin/chromium, `apt-get install chromium`; no browser
download). Every numbered notebook is opened, run with Run -> Run All Cells and checked for error
outputs, loaded figures and rendered widget views; in notebook 05 every view's slider and toggle
is moved and the prompt probe run again, and each must re-render its figure. The copies carry the
notebook tests' smoke parameters in a cell after their parameters cell, as papermill injects them,
so what a run exports is also the second run that tests/test_figures_deterministic.py compares
byte for byte with the papermill run; each notebook's test runs on the worker of its group. Full-page screenshots
go to the test's temporary folder and to outputs/browser/ (git-ignored) when that folder can be
written.

Skips, saying why, only when /usr/bin/chromium or the playwright package is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import BROWSER_EXPORTS, SMOKE_THREADS, group_of, notebook_group

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
# without the background-networking flags Chromium keeps dialing out, and a closed network
# answers every try with a refused connection
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_S = 90  # JupyterLab answering on its port
KERNEL_READY_S = 90  # the notebook's kernel started and idle
RUN_ALL_S = 300  # Run All Cells until the kernel is idle again (measured: at most 28 s, notebook 04)
RERENDER_S = 120  # a moved control or the probe's run button until the new figure is shown
ACTION_MS = 30_000  # Playwright's bound on any one click, fill or wait for an element

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
STDERR_MIME = "application/vnd.jupyter.stderr"
# every numbered notebook (measured on two shared cores, Run All Cells: 01 15 s, 02 6 s, 03 5 s,
# 04 28 s, 05 19 s; the whole file about 2 minutes). 05 holds every widget view and gets the
# control checks; the others show static figures.
NOTEBOOKS = sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


# ---------------------------------------------------------------------- the tools, or a skip
def _require_browser(config):
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        missing.append(f"the playwright package is not importable ({exc}; pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} is missing (apt-get install chromium)")
    if missing:
        reason = "browser test skipped: " + "; ".join(missing)
        # on the terminal past the capture: `pytest -q` lists no skip reasons
        capture = config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"\n{reason}", file=sys.stderr, flush=True)
        pytest.skip(reason)


# ---------------------------------------------------------------------- JupyterLab
class Lab:
    """A JupyterLab server on a free local port over a temporary copy of notebooks/, each copy
    run with the smoke parameters on `checkpoint`, exporting into `exports/<notebook>`."""

    def __init__(self, base: Path, checkpoint: str):
        self.base = base
        self.root = base / "lab" / "notebooks"
        shutil.copytree(REPO / "notebooks", self.root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        for name in NOTEBOOKS:
            self.exports(name).mkdir(parents=True)
            _inject_parameters(
                self.root / f"{name}.ipynb",
                {"checkpoint": checkpoint, "smoke": True, "output_dir": str(self.exports(name))},
            )
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "jupyterlab.log"
        self.proc: subprocess.Popen | None = None

    def exports(self, name: str) -> Path:
        return self.base / "exports" / name

    def env(self) -> dict:
        private = self.base / "jupyter"
        # live widgets, not static figures; the kernel is this Python's (no kernelspec from JUPYTER_PATH)
        env = {k: v for k, v in os.environ.items() if k not in ("DSV41_HEADLESS", "JUPYTER_PATH")}
        env.update(
            {
                "JUPYTER_CONFIG_DIR": str(private / "config"),
                "JUPYTER_RUNTIME_DIR": str(private / "runtime"),
                "JUPYTER_DATA_DIR": str(private / "data"),
                "JUPYTERLAB_SETTINGS_DIR": str(private / "settings"),
                "JUPYTERLAB_WORKSPACES_DIR": str(private / "workspaces"),
                "IPYTHONDIR": str(private / "ipython"),
                "DSV41_CACHE": str(
                    self.base / "dsv41-cache"
                ),  # the tiny checkpoint and native kernel, never the user's cache
                "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
                # the notebook tests' torch threads (conftest.SMOKE_THREADS), so both runs are alike
                "OMP_NUM_THREADS": str(SMOKE_THREADS),
            }
        )
        return env

    def _settings(self) -> None:
        """User settings in the private settings folder: every cell attached to the DOM (the
        checks read all outputs), no news or update checks (no network, no toast)."""
        settings = self.base / "jupyter" / "settings" / "@jupyterlab"
        for rel, value in (
            ("notebook-extension/tracker.jupyterlab-settings", {"windowingMode": "none"}),
            ("apputils-extension/notification.jupyterlab-settings", {"fetchNews": "false", "checkForUpdates": False}),
        ):
            path = settings / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))

    def start(self) -> None:
        self._settings()
        cmd = [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.expose_app_in_browser=True",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        log = open(self.log_path, "wb")
        # its own session, so the finalizer can end the server and the kernels it started together
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"JupyterLab exited with {self.proc.returncode} before answering:\n{self.log_tail()}"
                )
            try:
                self.api("GET", "/api/status", timeout=5)
                return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"JupyterLab did not answer on {self.url} within {SERVER_START_S} s:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def api(self, method: str, path: str, timeout: float = 10):
        req = urllib.request.Request(self.url + path, method=method, headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def kernel_state(self, name: str) -> str | None:
        """The execution state of the kernel of the session on notebook `name`, None without one."""
        for session in self.api("GET", "/api/sessions"):
            if session.get("path", "").endswith(name) and session.get("kernel"):
                return session["kernel"].get("execution_state")
        return None

    def shutdown_sessions(self) -> None:
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}", timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.api("POST", "/api/shutdown", timeout=10)  # shuts its kernels down first
            self.proc.wait(timeout=20)
        except Exception:
            pass
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)  # the group this test started (start_new_session)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # a kernel left behind in the group
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def _inject_parameters(path: Path, values: dict) -> None:
    """A cell tagged `injected-parameters` after the notebook's parameters cell, setting `values`,
    as papermill adds one (`dsv41 notebooks -p smoke true --checkpoint DIR` passes these)."""
    import nbformat
    from nbformat.v4 import new_code_cell

    nb = nbformat.read(str(path), as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", []))
    source = "# Parameters of the notebook tests' smoke run\n" + "\n".join(f"{k} = {v!r}" for k, v in values.items())
    nb.cells.insert(at + 1, new_code_cell(source, metadata={"tags": ["injected-parameters"]}))
    nbformat.write(nb, str(path))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# one server and one browser per test worker: the notebooks' tests are spread over the workers by group
@pytest.fixture(scope="session")
def lab(tmp_path_factory, pytestconfig, tiny_checkpoint):
    _require_browser(pytestconfig)
    server = Lab(tmp_path_factory.mktemp("browser"), tiny_checkpoint)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def browser_context(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(lab.base / "chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
            timeout=60_000,
        )
        context.set_default_timeout(ACTION_MS)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def notebook_page(lab, browser_context, request):
    """A fresh tab; afterwards the kernels are shut down (the next notebook starts on a quiet
    machine) and the browser console's errors are printed."""
    page = browser_context.new_page()
    console: list[str] = []
    page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: console.append(f"pageerror: {exc}"))
    try:
        yield page
    finally:
        if console:
            print(f"browser console errors ({len(console)}):\n" + "\n".join(console[:20]))
        try:
            page.close()
        finally:
            lab.shutdown_sessions()


def _out_dirs(tmp_path: Path) -> list[Path]:
    dirs = [tmp_path]
    repo_out = REPO / "outputs" / "browser"
    try:
        repo_out.mkdir(parents=True, exist_ok=True)
        if os.access(repo_out, os.W_OK):
            dirs.append(repo_out)
    except OSError:
        pass
    return dirs


# ---------------------------------------------------------------------- driving the page
def _wait(predicate, timeout_s: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval)


PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"

_PROMPTS_JS = f"""() => Array.from(document.querySelectorAll('{PANEL} .jp-CodeCell .jp-InputArea-prompt'))
                     .map(e => e.textContent.trim())"""


def _open(page, lab: Lab, name: str) -> None:
    """Open notebook `name` in a workspace of its own (nothing restored from another test) and
    wait for its kernel to be idle."""
    page.goto(f"{lab.url}/lab/workspaces/{name}/tree/{name}.ipynb?reset&token={lab.token}")
    page.locator(f"{PANEL} .jp-Notebook").wait_for()
    _wait(lambda: lab.kernel_state(name + ".ipynb") == "idle", KERNEL_READY_S, f"the kernel of {name} to be idle")
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
        " && window.jupyterapp.shell.currentWidget.sessionContext"
        " && window.jupyterapp.shell.currentWidget.sessionContext.kernelDisplayStatus === 'idle'",
        timeout=KERNEL_READY_S * 1000,
    )
    # the left sidebar off, so a screenshot is the notebook
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")


def _run_all(page, lab: Lab, name: str) -> float:
    """Run -> Run All Cells, then wait until no cell is queued or running and the kernel is idle.
    Returns the seconds it took."""
    page.locator(f"{PANEL} .jp-Notebook").click(position={"x": 5, "y": 5})  # the notebook has focus
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    start = time.monotonic()
    quiet_since = None
    deadline = start + RUN_ALL_S
    while True:
        prompts = page.evaluate(_PROMPTS_JS)
        busy = any("*" in p for p in prompts)
        idle = not busy and lab.kernel_state(name + ".ipynb") == "idle"
        all_numbered = bool(prompts) and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts)
        now = time.monotonic()
        if idle:
            quiet_since = quiet_since or now
            # done: every cell ran, or (an error stopped the queue) nothing moved for a few seconds
            if (all_numbered and now - quiet_since >= 1.0) or now - quiet_since >= 5.0:
                return now - start
        else:
            quiet_since = None
        if now > deadline:
            raise AssertionError(f"{name}: Run All did not finish within {RUN_ALL_S} s; prompts {prompts}")
        time.sleep(0.5)


def _save(page, lab: Lab, name: str) -> dict:
    """Save the notebook from the browser (Ctrl+S) and read what was saved."""
    path = lab.root / f"{name}.ipynb"
    before = path.stat().st_mtime_ns
    page.locator(f"{PANEL} .jp-Notebook").click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")  # command mode
    page.keyboard.press("Control+s")
    _wait(
        lambda: path.stat().st_mtime_ns != before and not page.locator(".jp-mod-dirty").count(),
        30,
        f"{name}.ipynb to be saved",
    )
    return json.loads(path.read_text())


_DOM_JS = f"""() => {{
  const panel = document.querySelector('{PANEL}');
  const outs = Array.from(panel.querySelectorAll('.jp-OutputArea-output'));
  const loaded = img => img.complete && img.naturalWidth > 0;
  // a widget view's output carries no data-mime-type (a rendermime output does)
  const widgetOuts = outs.filter(o => !o.hasAttribute('data-mime-type'));
  return {{
    stderr: outs.filter(o => o.getAttribute('data-mime-type') === '{STDERR_MIME}').map(o => o.innerText),
    outputText: outs.map(o => o.innerText).join('\\n'),
    widgetOutputs: widgetOuts.map(o => ({{
      rendered: !!o.querySelector('.jupyter-widgets'),
      images: Array.from(o.querySelectorAll('img.widget-image'))
                .map(i => ({{loaded: loaded(i), src: i.src.slice(0, 5)}})),
      controls: [...new Set(Array.from(o.querySelectorAll(
                   '.widget-slider, .widget-toggle-buttons, button.widget-button, .widget-text, .widget-tab'))
                 .flatMap(c => Array.from(c.classList))
                 .filter(k => ['widget-slider', 'widget-toggle-buttons', 'widget-button', 'widget-text',
                               'widget-tab'].includes(k)))].sort(),
      text: o.innerText.slice(0, 200)}})),
    staticImages: Array.from(panel.querySelectorAll('.jp-RenderedImage img')).map(loaded),
  }};
}}"""


def _check_outputs(name: str, nb: dict, dom: dict) -> None:
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    unrun = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and not c.get("execution_count")]
    errors = [
        f"cell {i}: {o.get('ename')}: {o.get('evalue')}"
        for i, c in enumerate(nb["cells"])
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors, f"{name}: error outputs: {errors}"
    assert not unrun, f"{name}: cells never ran (an earlier error stopped Run All?): {unrun}"
    tracebacks = [t for t in dom["stderr"] if "Traceback" in t or "Error" in t.split("\n")[0]]
    assert not tracebacks, f"{name}: tracebacks on stderr in the page: {[t[:500] for t in tracebacks]}"
    assert "Error displaying widget" not in dom["outputText"], f"{name}: a widget failed to display"
    assert "Error rendering output" not in dom["outputText"], f"{name}: an output failed to render"
    # every widget output the kernel sent is a rendered widget, with its figures loaded
    sent = sum(1 for c in code for o in c.get("outputs", []) if WIDGET_MIME in o.get("data", {}))
    assert len(dom["widgetOutputs"]) == sent, (
        f"{name}: {sent} widget outputs sent, {len(dom['widgetOutputs'])} in the page"
    )
    for i, view in enumerate(dom["widgetOutputs"]):
        assert view["rendered"], f"{name}: widget output {i} not rendered: {view['text']!r}"
        assert view["images"] and all(img["loaded"] for img in view["images"]), (
            f"{name}: widget output {i} has no loaded figure: {view}"
        )
    assert dom["staticImages"] and all(dom["staticImages"]), (
        f"{name}: a static figure did not load: {dom['staticImages']}"
    )


def _screenshot(page, name: str, out_dirs: list[Path]) -> list[Path]:
    """The whole notebook: the viewport grown to the notebook's height for the shot, then restored."""
    size = page.viewport_size
    height = page.evaluate(f"""() => {{
        const panel = document.querySelector('{PANEL}');
        const inner = panel.querySelector('.jp-WindowedPanel-outer') || panel.querySelector('.jp-Notebook');
        return inner.scrollHeight + (window.innerHeight - inner.clientHeight);
    }}""")
    page.set_viewport_size({"width": size["width"], "height": min(max(int(height) + 40, size["height"]), 16000)})
    page.evaluate(f"""() => document.querySelectorAll('{PANEL} .jp-WindowedPanel-outer, {PANEL} .jp-Notebook')
                                  .forEach(e => {{ e.scrollTop = 0; }})""")
    page.wait_for_timeout(500)
    paths = []
    try:
        first = out_dirs[0] / f"{name}.png"
        page.screenshot(path=str(first), full_page=True)
        paths.append(first)
        for d in out_dirs[1:]:
            shutil.copyfile(first, d / first.name)
            paths.append(d / first.name)
    finally:
        page.set_viewport_size(size)
    return paths


def _srcs(view) -> list[str]:
    images = view.locator("img.widget-image")
    return [images.nth(i).get_attribute("src") or "" for i in range(images.count())]


def _rerenders(view, action, what: str) -> None:
    """`action()` moves a control of `view`; a figure of that view must be re-rendered (a new
    image src: the Image widget's value changed)."""
    before = _srcs(view)
    action()
    _wait(lambda: (now := _srcs(view)) and all(now) and now != before, RERENDER_S, f"{what} to re-render its figure")


def _label(control) -> str:
    labels = control.locator(".widget-label")
    return labels.first.inner_text().strip() if labels.count() else "?"


def _move_slider(slider) -> None:
    """To one end from the keyboard, as a person would (End, or Home when already there)."""
    readout = slider.locator(".widget-readout")
    handle = slider.locator(".noUi-handle")
    before = readout.inner_text()
    handle.focus()
    handle.press("End")
    try:
        _wait(lambda: readout.inner_text() != before, 2, "the readout", interval=0.1)
    except AssertionError:
        handle.press("Home")
        _wait(lambda: readout.inner_text() != before, 5, f"slider {_label(slider)!r} to move", interval=0.1)


# ---------------------------------------------------------------------- the tests
@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=notebook_group(group_of(n))) for n in NOTEBOOKS])
def test_notebook_runs_clean_in_jupyterlab(lab, notebook_page, name, tmp_path):
    page = notebook_page
    out_dirs = _out_dirs(tmp_path)
    _open(page, lab, name)
    try:
        seconds = _run_all(page, lab, name)
    except AssertionError:
        _screenshot(page, f"{name}-timed-out", out_dirs)
        raise
    print(f"{name}: Run All Cells took {seconds:.1f} s in JupyterLab")
    # what Run All exported, before any control moves (tests/test_figures_deterministic.py)
    exported = shutil.copytree(lab.exports(name), tmp_path / "exports")
    nb = _save(page, lab, name)
    dom = page.evaluate(_DOM_JS)
    shots = _screenshot(page, name, out_dirs)
    print(f"{name}: screenshots {', '.join(map(str, shots))}")
    _check_outputs(name, nb, dom)
    BROWSER_EXPORTS[name[:2]] = exported
    if name == "05_generation":
        # at least the routing, expert-cache and tie views, and the prompt probe
        controls = [v["controls"] for v in dom["widgetOutputs"]]
        assert ["widget-toggle-buttons"] in controls and controls.count(["widget-slider"]) >= 2, controls
        assert any({"widget-tab", "widget-button", "widget-text"} <= set(c) for c in controls), controls
        _check_controls(page, name, out_dirs)


def _check_controls(page, name: str, out_dirs: list[Path]) -> None:
    """Notebook 05: every view's sliders and toggle buttons re-render its figure; the probe's run
    button regenerates, and its three tabs and status show the new run."""
    outputs = page.locator(f"{PANEL} .jp-OutputArea-output:not([data-mime-type])")
    views = [outputs.nth(i) for i in range(outputs.count())]
    probes = [v for v in views if v.locator(".widget-tab").count()]
    assert len(probes) == 1, f"{len(probes)} prompt probes (widget outputs with tabs)"
    probe = probes[0]
    moved = []
    for view in views:
        if view is probe:
            continue
        for slider in view.locator(".widget-slider").all():
            label = _label(slider)
            _rerenders(view, lambda: _move_slider(slider), f"slider {label!r}")
            moved.append(f"slider {label!r}")
        for toggle in view.locator(".widget-toggle-buttons").all():
            label = _label(toggle)
            other = toggle.locator("button.widget-toggle-button:not(.mod-active)").first
            option = other.inner_text().strip()
            _rerenders(view, other.click, f"toggle {label!r} -> {option!r}")
            moved.append(f"toggle {label!r} -> {option!r}")
    print(f"{name}: re-rendered by {', '.join(moved)}")
    assert sum(m.startswith("slider") for m in moved) >= 2 and any(m.startswith("toggle") for m in moved), moved

    # the probe: a new prompt and token count, then run
    status = probe.locator(".widget-html")
    before_status = status.inner_text()
    tabs = probe.locator(".widget-tab")
    assert tabs.locator("img.widget-image").count() == 3, (
        "the probe's three tabs (routing, cache, ties) each hold a figure"
    )
    before = _srcs(tabs)
    probe.locator(".widget-text input[type=text]").fill("Hello there")
    tokens = probe.locator(".widget-text input[type=number]")
    tokens.fill("3")
    tokens.press("Enter")
    probe.locator("button.widget-button", has_text=re.compile(r"^run$")).click()
    # the status reads running / generating / comparing while it works, then "N prompt tokens, M generated"
    _wait(
        lambda: re.search(r"\d+ prompt tokens, \d+ generated", t := status.inner_text()) and t != before_status,
        RERENDER_S,
        "the probe's run to finish",
    )
    text = status.inner_text()
    assert "3 generated" in text, f"the probe's status after a 3-token run: {text!r}"
    _wait(lambda: all(a != b for a, b in zip(_srcs(tabs), before)), 30, "the probe's three figures to re-render")
    dom = page.evaluate(_DOM_JS)
    assert "Error displaying widget" not in dom["outputText"]
    assert not [t for t in dom["stderr"] if "Traceback" in t], dom["stderr"]
    print(f"{name}: probe status after run: {text}")
    _screenshot(page, f"{name}-after-controls", out_dirs)
