"""The notebooks as a person uses them: JupyterLab in headless Chromium, Run All, then the chat box.

papermill (tests/test_notebooks.py) proves the cells run; only a browser shows that the front end renders
the plots and the ipywidgets chat box, and that Enter in that box answers. The test starts its own
JupyterLab on 127.0.0.1 (a free port, a random token) over a copy of the notebooks in a temporary folder,
so Run All never writes outputs into the committed .ipynb files. GEMMA4LIB_CACHE passes through to the
kernels, so with a warm cache every graph is a cache hit. Screenshots go to runs/browser/.

Needs Debian's chromium and chromium-driver and the `browser` extra: `bash scripts/setup_browser.sh`.
Marked `browser`: it skips, saying why, where no browser is installed, so the default
`scripts/run_tests.sh` passes there; `.ci/run` installs the browser and runs it as a step of its own
after the main suite (which leaves it out), when the compile cache is warm."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "runs" / "browser"
NOTEBOOKS = ["01_e2b", "05_26b_a4b"]
QUESTION, ANSWER = "What is the capital of France?", "Paris"  # the tiny trained fixtures answer capitals
RUN_ALL_TIMEOUT_S = 240
CHAT_TIMEOUT_S = 60
# a cell that draws: a line calling plots.<something>(...), maybe assigned
PLOT_CALL = re.compile(r"^\s*(?:\w+\s*=\s*)?plots\.\w+\(", re.MULTILINE)

SETUP_HINT = "run `bash scripts/setup_browser.sh` (Debian's chromium and chromium-driver, selenium, jupyterlab)"


def _missing() -> str | None:
    """Why the test cannot run here, or None."""
    for binary in ("chromium", "chromedriver"):
        if shutil.which(binary) is None:
            return f"no `{binary}` on PATH; {SETUP_HINT}"
    for module in ("selenium", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            return f"Python package `{module}` is not installed; {SETUP_HINT}"
    return None


if (_reason := _missing()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Lab:
    """A JupyterLab server of our own, over a temporary copy of notebooks/."""

    def __init__(self, workdir: Path):
        self.root = workdir / "notebooks"  # results_path is "../runs/...": it lands in workdir/runs
        self.root.mkdir(parents=True)
        for notebook in (ROOT / "notebooks").glob("*.ipynb"):
            shutil.copy(notebook, self.root / notebook.name)
        self.port, self.token = _free_port(), secrets.token_hex(16)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        # no user settings or saved workspace: the page opens the same way on every machine
        for var, sub in (("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")):
            env[var] = str(workdir / "lab" / sub)
        news = workdir / "lab" / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        news.parent.mkdir(parents=True)
        news.write_text('{"fetchNews": "false"}')  # no "get notified about Jupyter news?" over the screenshots
        command = [
            sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
            f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
            "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run commands, read cell models
        ]  # fmt: skip
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-root")
        self.log = (workdir / "lab.log").open("w")
        self.proc = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"JupyterLab did not answer within {timeout_s} s; see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _committed_notebooks() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    before = _committed_notebooks()
    server = Lab(tmp_path_factory.mktemp("lab"))
    yield server
    server.stop()
    assert _committed_notebooks() == before, "the browser run changed a committed notebook; it must use its copy"


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=shutil.which("chromedriver")))
    yield driver
    driver.quit()


# JavaScript run in the page, through JupyterLab's own application object
NOTEBOOK_READY = """
const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
if (!w || !w.context || !w.context.path.endsWith(arguments[0]) || !w.sessionContext) return false;
const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
return !!kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle' && w.content.widgets.length > 0;
"""
CELLS = """
const nb = window.jupyterapp.shell.currentWidget.content;
return nb.widgets.map((c, i) => ({index: i, type: c.model.type}))
  .filter(c => c.type === 'code').map(({index}) => {
    const c = nb.widgets[index];
    const prompt = c.node.querySelector('.jp-InputPrompt');
    return {
      index: index,
      source: c.model.sharedModel.getSource(),
      count: c.model.executionCount,
      busy: !!prompt && prompt.textContent.includes('*'),
      outputs: c.model.outputs.toJSON().map(o => ({
        type: o.output_type, mimes: Object.keys(o.data || {}), name: o.name || null,
        text: o.output_type === 'error' ? o.ename + ': ' + o.evalue
            : (o.output_type === 'stream' ? [].concat(o.text).join('') : ''),
      })),
      images: c.node.querySelectorAll('.jp-OutputArea-output img, .jp-OutputArea-output svg').length,
    };
  });
"""
INSERT_ABOVE = """
const done = arguments[arguments.length - 1];
const app = window.jupyterapp, nb = app.shell.currentWidget.content;
nb.activeCellIndex = arguments[0];
app.commands.execute('notebook:insert-cell-above').then(() => {
  nb.activeCell.model.sharedModel.setSource(arguments[1]);
  done(nb.activeCellIndex);
});
"""
RUN_CELL = """
const app = window.jupyterapp, nb = app.shell.currentWidget.content;
nb.activeCellIndex = arguments[0];
nb.deselectAll();
app.commands.execute('notebook:run-cell');  // not returned: Selenium would wait for the promise
"""


def _wait(browser, what: str, timeout_s: float, probe):
    """Poll `probe()` until it returns something truthy; fail saying what did not happen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(1)
    _shot(browser, f"timeout-{re.sub(r'[^a-z0-9]+', '-', what.lower())}")
    pytest.fail(f"{what}: not within {timeout_s} s (screenshot in {SHOTS})")


def _shot(browser, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    browser.save_screenshot(str(path))
    return path


def _errors(cells: list[dict]) -> list[str]:
    found = []
    for cell in cells:
        for out in cell["outputs"]:
            if out["type"] == "error" or (out["name"] == "stderr" and "Traceback" in out["text"]):
                found.append(f"cell {cell['index']}: {out['text'][-500:]}")
    return found


def _scroll_to(browser, index: int) -> None:
    browser.execute_script(
        "window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]].node.scrollIntoView();", index
    )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_run_all_then_ask_the_chat_box(lab, browser, name):
    browser.get(f"{lab.url}/lab/tree/{name}.ipynb?token={lab.token}")
    _wait(
        browser, f"{name} open with an idle kernel", 90, lambda: browser.execute_script(NOTEBOOK_READY, f"{name}.ipynb")
    )

    started = time.monotonic()
    browser.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")  # no await

    def finished():
        cells = browser.execute_script(CELLS)
        if _errors(cells):
            return cells  # Run All stops at an error: report it now
        if all(c["count"] is not None and not c["busy"] for c in cells):
            return cells
        return None

    cells = _wait(browser, f"{name} Run All", RUN_ALL_TIMEOUT_S, finished)
    run_all_s = time.monotonic() - started
    assert not _errors(cells), f"{name}: error output in " + "; ".join(_errors(cells))
    unfinished = [c["index"] for c in cells if c["count"] is None or c["busy"]]
    assert not unfinished, f"{name}: cells {unfinished} did not finish"

    plot_cells = [c for c in cells if PLOT_CALL.search(c["source"])]
    assert plot_cells, f"{name}: no cell calls plots.*(...); has the notebook changed how it draws?"
    blank = [
        c["index"]
        for c in plot_cells
        if not c["images"] or not any("image/" in m for o in c["outputs"] for m in o["mimes"])
    ]
    assert not blank, f"{name}: plot cells {blank} rendered no image: " + "; ".join(
        f"{c['index']}: {c['images']} images, outputs {[(o['type'], o['mimes']) for o in c['outputs']]}"
        for c in plot_cells
        if c["index"] in blank
    )
    assert sum(c["images"] for c in cells) >= len(plot_cells)
    _scroll_to(browser, plot_cells[-1]["index"])
    _shot(browser, f"{name}-run-all")

    # the chat, as a person turns it on: a new cell `interactive = True` above the chat cell, run both (not
    # the parameters cell again: it would set `model` back to the string "auto")
    chat_index = next(c["index"] for c in cells if "nb.chat(" in c["source"])
    browser.execute_async_script(INSERT_ABOVE, chat_index, "interactive = True")
    browser.execute_script(RUN_CELL, chat_index)  # the new cell
    chat_index += 1
    browser.execute_script(RUN_CELL, chat_index)

    def chat_input():
        node = browser.execute_script(
            "return window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]].node"
            ".querySelector('.jp-OutputArea-output .widget-text input');",
            chat_index,
        )
        return node

    box = _wait(browser, f"{name} chat box shown", CHAT_TIMEOUT_S, chat_input)
    _scroll_to(browser, chat_index)
    # every text the answer line shows, as the page sees it: streamed means several, growing
    browser.execute_script(
        "const out = window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]].node;"
        "window.chatTexts = [];"
        "new MutationObserver(() => { const n = out.querySelector('.widget-html');"
        "  if (n && n.textContent !== window.chatTexts.at(-1)) window.chatTexts.push(n.textContent); })"
        ".observe(out, {subtree: true, childList: true, characterData: true});",
        chat_index,
    )
    box.click()
    box.send_keys(QUESTION)
    box.send_keys(Keys.ENTER)

    def answer():
        return browser.execute_script(
            "const n = window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]].node"
            ".querySelector('.jp-OutputArea-output .widget-html');"
            "return n && n.textContent.includes(arguments[1]) ? n.textContent : null;",
            chat_index,
            ANSWER,
        )

    text = _wait(browser, f"{name} chat answer containing {ANSWER!r}", CHAT_TIMEOUT_S, answer)
    assert text.startswith("model:"), text
    seen = [t for t in browser.execute_script("return window.chatTexts;") if t.startswith("model:")]
    assert len(seen) >= 3 and ANSWER not in seen[0], f"the answer did not stream, the page showed only {seen}"
    _shot(browser, f"{name}-chat")
    print(
        f"{name}: Run All {run_all_s:.0f} s, {len(plot_cells)} plot cells rendered, "
        f"chat answered {text!r} in {len(seen)} streamed updates"
    )
