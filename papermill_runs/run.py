"""`python -m papermill_runs run|check|bench`: execute the notebooks headless and judge the results.

    python -m papermill_runs run --profile smoke [--variant e2b --variant 12b] [--out runs/smoke]
                                 [--update-baseline] [--allow-missing-baseline] [--timeout-per-cell 900]
                                 [-p KEY=VALUE ...]
    python -m papermill_runs check --results runs/smoke/results.json [--update-baseline] ...

`run` executes each variant notebook with papermill (its `parameters` cell overridden by the
profile's values from `profiles.json`, then `-p`), in a kernel that is always this interpreter,
with a per-cell timeout and the cell output logged to `OUT/logs/`. It collects the JSON record
each notebook writes, judges it against `baselines/<profile>/<machine-kind>.json` with
`tolerances.json`, runs the overview notebook last (it reads the same records), and writes into
OUT: `notebooks/` (executed), `logs/`, `results/`, `results.json`, `summary.md`, `summary.csv`
and PNG plots. It appends one line per variant to the history file and prints the table.

`check` re-judges an existing `results.json` without executing anything. `bench` judges a
`python -m gemma4lab bench --json` report against its baseline, as ratios (see `bench.py`).

Exit status: 0 when every notebook ran and every variant passed; 1 when a notebook failed, a
check failed, a metric regressed, or a baseline is missing (unless `--allow-missing-baseline`);
2 when a baseline or tolerance file is malformed or the arguments are wrong. With
`--update-baseline`, speed regressions and missing baselines are accepted (the new figures are
written) but failed notebooks and failed checks still exit 1, and their figures are not recorded.
The figures written are the median of this run and the last few correct runs in the history
(`--baseline-runs`), because one timing on a shared CPU can be off by several times.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemma4lib.cache.artifacts import atomic_write_json
from gemma4lib.errors import BaselineError
from gemma4lib.models.variants import ALIASES as variant_aliases
from gemma4lib.models.variants import VARIANTS

from . import baselines, bench, report
from .judge import judge_results
from .parameters import check_overrides, coerce, declared_parameters

log = logging.getLogger("papermill_runs")

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
PROFILES_FILE = PACKAGE_DIR / "profiles.json"
KERNEL_NAME = "python3"
VARIANT_NOTEBOOKS = {v.name: v.notebook for v in VARIANTS.values()}  # `Variant.notebook`
OVERVIEW = ("overview", "00_overview.ipynb")
# 06_serving: batches and drafting on the tiny E2B; judged like a variant notebook (its record has
# the three checks), run after the variant notebooks, only in profiles with a "serving" block
SERVING = ("serving", "06_serving.ipynb")
# 07_serve: the endpoint on the tiny E2B (06_serving's batched graphs, from the cache); its record is
# not a port's (no baseline): it fails the run when its own checks do. Only in profiles with a "serve" block
SERVE = ("serve", "07_serve.ipynb")
OWN_BLOCK = (SERVING, SERVE)  # notebooks that take their profile block alone, and only where it exists
NOTEBOOK_FILES = {**VARIANT_NOTEBOOKS, SERVING[0]: SERVING[1], SERVE[0]: SERVE[1], OVERVIEW[0]: OVERVIEW[1]}
RUN_ORDER = [*VARIANT_NOTEBOOKS, SERVING[0], SERVE[0], OVERVIEW[0]]
UNJUDGED = (SERVE[0], OVERVIEW[0])  # no baseline: the notebook's run (and its record's checks) decide
# every variant's names (`Variant.names`: aliases, notebook number), the other notebooks' names and
# numbers, and "all"
ALIASES = {
    **variant_aliases,
    OVERVIEW[1][:2]: "overview",
    SERVING[1][:2]: "serving",
    "serving": "serving",
    SERVE[1][:2]: "serve",
    "serve": "serve",
    "all": "all",
}


# ---- arguments --------------------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """`-p key=value`: JSON when it parses (numbers, true/false/null, lists), the plain string otherwise."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"error: -p expects KEY=VALUE, got {item!r}")
        out[key.strip()] = parse_value(value)
    return out


def selected(names: Sequence[str] | None) -> list[str]:
    """Notebook names in run order (the variants, serving, serve, the overview last); default: everything."""
    if not names:
        return list(RUN_ORDER)
    wanted = []
    for item in names:
        for raw in item.split(","):
            key = ALIASES.get(raw.strip().lower().replace("_", "-"), raw.strip().lower())
            if key == "all":
                return list(RUN_ORDER)
            if key not in NOTEBOOK_FILES:
                choices = ", ".join(RUN_ORDER)
                raise SystemExit(f"error: unknown variant {raw!r}; choose from {choices}")
            if key not in wanted:
                wanted.append(key)
    return [k for k in RUN_ORDER if k in wanted]


def load_profiles(path: Path = PROFILES_FILE) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BaselineError(f"profile file {path} is unreadable: {exc}") from None


def notebook_parameters(
    profiles: dict[str, Any], profile: str, name: str, out: Path, overrides: dict[str, Any]
) -> dict[str, Any]:
    block = profiles.get(profile)
    if not isinstance(block, dict):
        raise SystemExit(f"error: profile {profile!r} is not defined in {PROFILES_FILE}")
    if name == "overview":
        params = {
            **(block.get("overview") or {}),
            "results_dir": str(out / "results"),
            "results_path": str(out / "results" / "overview.json"),
        }
    elif name in dict(OWN_BLOCK):  # its own block only: it runs the tiny models on a CPU whatever the profile
        if not isinstance(block.get(name), dict):
            file = dict(OWN_BLOCK)[name]
            raise SystemExit(f"error: profile {profile!r} runs no {file} (no {name!r} block in {PROFILES_FILE})")
        params = {**block[name], "results_path": str(out / "results" / f"{name}.json")}
    else:
        params = {
            **(block.get("common") or {}),
            **((block.get("variants") or {}).get(name) or {}),
            "results_path": str(out / "results" / f"{name}.json"),
        }
    return resolve_threads({**params, **overrides})


def host_threads() -> int:
    """Torch threads for the host side of a full run (the host reference, the logit spread): one
    per physical core this process may use. A 31B's host reference on one thread of an
    inf2.24xlarge (48 physical cores) takes ~48x as long as it needs to."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        usable = os.cpu_count() or 1
    try:
        import psutil

        logical, physical = psutil.cpu_count(logical=True), psutil.cpu_count(logical=False)
    except ImportError:  # pragma: no cover - psutil is a dependency
        logical = physical = None
    if logical and physical and logical > physical:  # hyper-threads: one thread per core
        usable = max(1, usable * physical // logical)
    return max(1, usable)


def resolve_threads(params: dict[str, Any]) -> dict[str, Any]:
    """`threads: "auto"` (the full profile's) becomes this machine's physical core count: the host
    reference of a big variant should not run on one core of a 48-core host. Smoke runs keep 1
    (benchmarks here are timed on one thread, the cores are shared)."""
    if params.get("threads") == "auto":
        params = {**params, "threads": host_threads()}
    return params


# ---- the kernel -------------------------------------------------------------------------------------


def kernelspec_dir(folder: Path) -> Path:
    """A Jupyter data folder holding a `python3` kernelspec that runs *this* interpreter.

    Put first on JUPYTER_PATH, it wins over any user or system `python3` kernelspec, so the notebooks
    always run in the environment papermill_runs was started from (a fresh clone's .venv included)."""
    spec = folder / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3",
                "language": "python",
                "metadata": {"debugger": False},
            }
        )
    )
    return folder


def kernel_environment(jupyter_dir: Path) -> dict[str, str]:
    paths = [str(jupyter_dir)] + [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    python_path = [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        "JUPYTER_PATH": os.pathsep.join(paths),
        "PYTHONPATH": os.pathsep.join(python_path),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    }


def kernel_transport(socket_dir: Path) -> dict[str, Any]:
    """papermill's `config=` for the kernel's connection: on Linux and macOS the kernel and papermill
    talk over IPC (Unix sockets in `socket_dir`, a private folder), so nothing listens on a TCP port.
    ipykernel warns for every kernel on TCP that its traffic is unencrypted; with IPC there is
    neither the exposure nor the warning. Elsewhere (no Unix sockets) the default TCP on 127.0.0.1."""
    from traitlets.config import Config

    if os.name != "posix":
        return {}
    return {"config": Config({"KernelManager": {"transport": "ipc", "ip": str(socket_dir / "kernel")}})}


class patched_environ:
    def __init__(self, values: dict[str, str]):
        self.values, self.saved = values, {}

    def __enter__(self):
        for key, value in self.values.items():
            self.saved[key] = os.environ.get(key)
            os.environ[key] = value

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---- executing one notebook -----------------------------------------------------------------------


def strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


PAPERMILL_TAGS = {"injected-parameters", "papermill-error-cell-tag"}


def failed_cell(executed: Path) -> dict[str, Any] | None:
    """The first cell papermill marked as failed (or left running, e.g. on a timeout).

    `index` counts cells of the *source* notebook (0-based, the cells papermill inserts, i.e. the
    injected parameters and the error banners, are skipped), so it points at the cell to fix."""
    try:
        import nbformat

        nb = nbformat.read(str(executed), as_version=4)
    except Exception:  # noqa: BLE001 - the executed notebook may be missing or half-written
        return None
    index = -1
    for cell in nb.cells:
        if PAPERMILL_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            continue
        index += 1
        meta = cell.get("metadata", {}).get("papermill", {})
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if cell.cell_type == "code" and (
            meta.get("exception") or meta.get("status") in ("failed", "running") or errors
        ):
            error = errors[0] if errors else {}
            return {
                "index": index,
                "exec_count": cell.get("execution_count"),
                "source": cell.source,
                "ename": error.get("ename"),
                "evalue": error.get("evalue"),
                "timed_out": meta.get("status") == "running" and not errors,
            }
    return None


class _LoggerUse:
    """The papermill logger's level and propagation while any notebook runs (set by the first, restored by the last)."""

    def __init__(self):
        self.lock, self.users, self.previous_level = threading.Lock(), 0, logging.NOTSET

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


_LOGGING = _LoggerUse()


def execute(
    name: str, file: str, out: Path, params: dict[str, Any], timeout: int | None, notebook_dir: Path = NOTEBOOK_DIR
) -> dict[str, Any]:
    """Run one notebook with papermill; never raises for a notebook failure (it is recorded instead)."""
    import papermill as pm

    source = notebook_dir / file
    executed = out / "notebooks" / file
    log_file = out / "logs" / (Path(file).stem + ".log")
    executed.parent.mkdir(parents=True, exist_ok=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    declared = declared_parameters(source)  # ast, not pm.inspect_notebook (it skips lines it cannot parse)
    unknown = sorted(k for k in params if k not in declared)
    params = {k: coerce(k, v, declared[k])[0] for k, v in params.items() if k in declared}
    run: dict[str, Any] = {
        "name": name,
        "notebook": file,
        "executed": str(executed),
        "log": str(log_file),
        "parameters": params,
        "ignored_parameters": unknown,
        "status": "ok",
    }
    started = time.perf_counter()
    pm_logger = logging.getLogger("papermill")
    with open(log_file, "w") as handle:
        file_handler = logging.StreamHandler(handle)
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        thread = threading.get_ident()  # two notebooks run at once (`execute_all`): each log keeps its own lines
        file_handler.addFilter(lambda record: record.thread == thread)
        with _LOGGING:
            if not _LOGGING.users:
                _LOGGING.previous_level = pm_logger.level
                pm_logger.setLevel(logging.INFO)
                pm_logger.propagate = False
            _LOGGING.users += 1
        pm_logger.addHandler(file_handler)
        handle.write(f"# {file} with {json.dumps(params, default=str)}\n")
        if unknown:
            handle.write(f"# parameters this notebook does not declare (ignored): {unknown}\n")
        handle.flush()
        try:
            with tempfile.TemporaryDirectory(prefix="gemma4lib-kernel-") as sockets:
                pm.execute_notebook(
                    str(source),
                    str(executed),
                    parameters=params,
                    kernel_name=KERNEL_NAME,
                    cwd=str(notebook_dir),
                    execution_timeout=timeout,
                    log_output=True,
                    stdout_file=handle,
                    stderr_file=handle,
                    progress_bar=False,
                    **kernel_transport(Path(sockets)),
                )
        except Exception as exc:  # noqa: BLE001 - PapermillExecutionError, CellTimeoutError, kernel death
            cell = failed_cell(executed) or {}
            if not cell and getattr(exc, "source", None) is not None:
                cell = {"index": None, "exec_count": getattr(exc, "exec_count", None), "source": exc.source}
            ename = getattr(exc, "ename", None) or cell.get("ename") or type(exc).__name__
            evalue = getattr(exc, "evalue", None) or cell.get("evalue") or str(exc).strip().splitlines()[-1:]
            if isinstance(evalue, list):
                evalue = evalue[0] if evalue else ""
            run.update(
                status="failed",
                failed_cell=cell or None,
                error=f"cell {cell.get('index', '?')} (In [{cell.get('exec_count') or ' '}]) raised {ename}: {evalue}",
            )
            handle.write(f"\n# FAILED: {run['error']}\n")
            trace = getattr(exc, "traceback", None)
            if trace:
                handle.write(strip_ansi("\n".join(trace)) + "\n")
        finally:
            pm_logger.removeHandler(file_handler)
            with _LOGGING:
                _LOGGING.users -= 1
                if not _LOGGING.users:
                    pm_logger.setLevel(_LOGGING.previous_level)
                    pm_logger.propagate = True
    run["wall_s"] = time.perf_counter() - started
    return run


def read_record(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    if not path.is_file():
        return None, f"no result record at {path}"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"unreadable result record {path}: {exc}"
    return (data, None) if isinstance(data, dict) else (None, f"result record {path} is not an object")


# ---- judging and writing (shared by run and check) ----------------------------------------------


def finish(
    out: Path,
    profile: str,
    kind: str,
    results: dict[str, Any],
    errors: dict[str, str],
    notebooks: dict[str, str],
    runs: dict[str, Any],
    args: argparse.Namespace,
    started_at: str,
    wall_s: float,
    extra: dict[str, Any] | None = None,
    append_history: bool = True,
) -> int:
    tolerances = baselines.load_tolerances(profile, args.tolerances)
    path = baselines.baseline_path(profile, kind, args.baseline_dir)
    metrics = list(tolerances.get("metrics") or {})
    baseline, state, baseline_error = None, "missing", None
    try:
        baseline = baselines.load_baseline(path, profile, kind, metrics)
        state = "missing" if baseline is None else "loaded"
    except BaselineError as exc:
        baseline_error = str(exc)
        state = "MALFORMED" + (", replaced (--update-baseline)" if args.update_baseline else "")
    judgement = judge_results(
        results,
        baseline,
        tolerances,
        notebooks=notebooks,
        errors=errors,
        runs=runs,
        baseline_error=baseline_error,
        allow_missing_baseline=args.allow_missing_baseline,
        updating_baseline=args.update_baseline,
    )
    verdicts, exit_code = judgement.verdicts, judgement.exit_code

    history_path = Path(args.history or Path("runs") / "history" / f"{profile}-{kind}.jsonl")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    updated = refused = []
    if args.update_baseline:
        present = {n: r for n, r in results.items() if r is not None}
        past = [
            h
            for h in baselines.read_history(history_path)
            if h.get("profile") == profile and h.get("machine_kind") == kind
        ]
        updated, refused = baselines.update_baseline(
            path, profile, kind, present, verdicts, baseline, past, metrics, args.baseline_runs
        )
        state += f"; updated {', '.join(updated) or 'nothing'}" + (f", refused {', '.join(refused)}" if refused else "")
    if append_history:
        baselines.append_history(
            history_path,
            [
                {
                    "time": stamp,
                    "profile": profile,
                    "machine_kind": kind,
                    "variant": name,
                    "verdict": v.status,
                    "git_sha": ((results.get(name) or {}).get("versions") or {}).get("git_sha"),
                    "metrics": {m: (results.get(name) or {}).get(m) for m in metrics},
                    "seq_match": (results.get(name) or {}).get("seq_match"),
                    "coherent": (results.get(name) or {}).get("coherent"),
                }
                for name, v in verdicts.items()
            ],
        )
    history = [h for h in baselines.read_history(history_path) if h.get("profile") == profile]

    meta = {
        "profile": profile,
        "machine_kind": kind,
        "started": started_at,
        "wall_s": wall_s,
        "baseline_file": str(path),
        "baseline_state": state,
        "exit_code": exit_code,
    }
    if baseline_error:
        meta["baseline_error"] = baseline_error
    atomic_write_json(
        out / "results.json",
        {
            **meta,
            "history_file": str(history_path),
            "tolerances": tolerances,
            "notebooks": runs,
            "results": results,
            "errors": errors,
            "verdicts": {n: v.to_dict() for n, v in verdicts.items()},
            **(extra or {}),
        },
    )
    tolerated = sorted(baselines.tolerated_statuses(args.allow_missing_baseline, args.update_baseline))
    table, failures = report.write_summary(out, results, verdicts, meta, runs, tolerated)
    for unjudged in UNJUDGED:  # no verdict row: their failures are listed here
        failed = runs.get(unjudged)
        if failed and failed.get("status") != "ok":
            failures += (
                ("\n" if failures else "") + f"ERROR: {failed['notebook']}: {failed.get('error')}\n"
                f"    executed: {failed['executed']}\n    log: {failed['log']}"
            )
    try:
        report.write_plots(out, results, verdicts, history)
    except Exception as exc:  # noqa: BLE001 - a plot must never hide the verdict
        print(f"warning: plots not written: {type(exc).__name__}: {exc}", file=sys.stderr)

    print(table)
    print(f"\n{profile} profile on {kind}: wall {wall_s:.0f} s; baseline {path} ({state}); out {out}")
    if baseline_error:
        print(f"\nerror: {baseline_error}", file=sys.stderr)
    if failures:
        print("\n" + failures)
    print(f"exit {exit_code}")
    return exit_code


def _announced(file: str, run: dict[str, Any]) -> dict[str, Any]:
    print(
        f"[papermill_runs] {file}: {run['status']} in {run['wall_s']:.0f} s"
        + (f" ({run['error']})" if run.get("error") else ""),
        flush=True,
    )
    return run


def execute_all(
    names: Sequence[str], params_of: dict[str, dict[str, Any]], out: Path, timeout: int | None, jobs: int
) -> dict[str, dict[str, Any]]:
    """Every notebook of `names`, `jobs` at a time, each with its own kernel (a process of its own, one
    thread: the notebooks time themselves on one thread), driven from a thread here. They share the
    artifact cache, whose build lock compiles a graph once even when two notebooks ask for it together.
    The overview reads the others' records, so it runs alone, last."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    # the longest first (06_serving: several batch sizes and drafting), so that no lane ends alone on it
    first = sorted((n for n in names if n != OVERVIEW[0]), key=lambda n: n != SERVING[0])
    runs: dict[str, dict[str, Any]] = {}
    if jobs > 1 and len(first) > 1:
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="papermill-runs") as pool:
            pending = {}
            for name in first:
                print(f"[papermill_runs] {NOTEBOOK_FILES[name]} ...", flush=True)
                pending[name] = pool.submit(execute, name, NOTEBOOK_FILES[name], out, params_of[name], timeout)
            named = {future: name for name, future in pending.items()}
            for future in as_completed(named):  # each reported when it ends
                runs[named[future]] = _announced(NOTEBOOK_FILES[named[future]], future.result())
        first = []
    for name in [*first, *(n for n in names if n == OVERVIEW[0])]:
        print(f"[papermill_runs] {NOTEBOOK_FILES[name]} ...", flush=True)
        run = execute(name, NOTEBOOK_FILES[name], out, params_of[name], timeout)
        runs[name] = _announced(NOTEBOOK_FILES[name], run)
    return runs


def cmd_run(args: argparse.Namespace) -> int:
    profile, kind = args.profile, args.machine_kind or baselines.machine_kind()
    out = Path(args.out or Path("runs") / profile).resolve()
    names = selected(args.variant)
    profiles = load_profiles()
    for own, own_file in OWN_BLOCK:
        if own in names and not isinstance((profiles.get(profile) or {}).get(own), dict):
            if args.variant:
                raise SystemExit(f"error: the {profile} profile has no {own_file} block in {PROFILES_FILE}")
            names.remove(own)  # the full profile leaves it out: it runs the tiny models only
    overrides = parse_overrides(args.param or [])
    files = [NOTEBOOK_FILES[name] for name in names]
    overrides, notes = check_overrides(overrides, [NOTEBOOK_DIR / f for f in files])  # before any notebook runs
    for note in notes:
        print(f"[papermill_runs] note: {note}", flush=True)
    baselines.load_tolerances(profile, args.tolerances)  # a broken tolerance file fails before any work
    (out / "results").mkdir(parents=True, exist_ok=True)
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    started = time.perf_counter()

    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    notebooks: dict[str, str] = {}
    params_of = {name: notebook_parameters(profiles, profile, name, out, overrides) for name in names}
    for params in params_of.values():
        Path(params["results_path"]).unlink(missing_ok=True)  # never collect a stale record
    with tempfile.TemporaryDirectory(prefix="papermill-runs-jupyter-") as jupyter:
        with patched_environ(kernel_environment(kernelspec_dir(Path(jupyter)))):
            runs = execute_all(names, params_of, out, args.timeout_per_cell, args.jobs)
    for name in names:
        file, run = NOTEBOOK_FILES[name], runs[name]
        record_path = Path(params_of[name]["results_path"])
        if name == SERVE[0] and run["status"] == "ok":
            record, problem = read_record(record_path)
            problem = problem or (
                None if record.get("checks_passed") is True else f"its checks failed: {record.get('failed_checks')}"
            )
            if problem:
                run.update(status="failed", error=problem)
                print(f"[papermill_runs] {file}: failed ({problem})", flush=True)
        if name in UNJUDGED:
            continue
        notebooks[name] = file
        record, problem = read_record(record_path)
        if run["status"] != "ok":
            problem = f"{file}: {run['error']}"
            record = None
        results[name] = record
        if problem:
            errors[name] = problem
    return finish(out, profile, kind, results, errors, notebooks, runs, args, started_at, time.perf_counter() - started)


def cmd_check(args: argparse.Namespace) -> int:
    path = Path(args.results)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: cannot read {path}: {exc}") from None
    profile = args.profile or data.get("profile") or "smoke"
    kind = args.machine_kind or data.get("machine_kind") or baselines.machine_kind()
    raw = data.get("results") or {}
    order = [n for n in RUN_ORDER if n in raw] + sorted(n for n in raw if n not in RUN_ORDER)
    results = {n: raw[n] for n in order}  # results.json is written with sorted keys: restore the run order
    notebooks = {n: NOTEBOOK_FILES.get(n, n) for n in results}
    runs = {n: r for n, r in (data.get("notebooks") or {}).items()}
    errors = {n: e for n, e in (data.get("errors") or {}).items() if results.get(n) is None}
    out = Path(args.out or path.parent).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return finish(
        out,
        profile,
        kind,
        results,
        errors,
        notebooks,
        runs,
        args,
        data.get("started") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        float(data.get("wall_s") or 0.0),
        {"rechecked_from": str(path)},
        append_history=False,
    )


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--machine-kind", help="baseline key (default: $GEMMA4LIB_MACHINE_KIND or <instance>-<arch>)")
    parser.add_argument("--baseline-dir", type=Path, help="default: papermill_runs/baselines")
    parser.add_argument("--tolerances", type=Path, help="default: papermill_runs/tolerances.json")
    parser.add_argument("--history", type=Path, help="append-only JSONL (default: runs/history/<profile>-<kind>.jsonl)")
    parser.add_argument(
        "--update-baseline",
        action="store_true",
        help="write this run's figures as the new baseline (variants whose checks passed)",
    )
    parser.add_argument(
        "--baseline-runs",
        type=int,
        default=5,
        help="--update-baseline writes the median of this run and the last N-1 correct runs in the "
        "history (default 5; 1 = this run alone)",
    )
    parser.add_argument(
        "--allow-missing-baseline", action="store_true", help="a variant without a baseline passes on its checks alone"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m papermill_runs", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="execute the notebooks, judge, report")
    p.add_argument("--profile", default="smoke", choices=["smoke", "full"])
    p.add_argument(
        "--variant", action="append", help=f"{', '.join(VARIANTS)}, serving, serve, overview (repeat or comma-separate)"
    )
    p.add_argument("--out", help="output folder (default: runs/<profile>)")
    p.add_argument("--timeout-per-cell", type=int, default=1800, help="seconds one cell may run (default 1800)")
    p.add_argument("-p", "--param", action="append", metavar="KEY=VALUE", help="notebook parameter override")
    p.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="notebooks run at once, each on one thread (default: 2, or 1 on a one-core machine); the overview "
        "runs last, alone",
    )
    _common(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("check", help="re-judge an existing results.json (no execution)")
    p.add_argument("--results", required=True)
    p.add_argument("--profile")
    p.add_argument("--out", help="where to write the summary (default: next to results.json)")
    _common(p)
    p.set_defaults(func=cmd_check)
    bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except BaselineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
