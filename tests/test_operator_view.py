"""The operator's view against real tools: the alert rules under promtool, every dashboard query
answered by a real Prometheus scraping a real `tpud run`, whose live view is driven under a
pseudo-terminal and read back as a terminal shows it (pyte), and `tpud status --watch`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pexpect
import pyte
import pytest
import yaml

from tests.conftest import PYTHON, REPO, python_env
from testkit.helpers import Daemon, job_text, wait_until, write
from tests.prometheus import prometheus  # noqa: F401  (the fixture)
from tpud.paths import Paths

ALERTS = REPO / "deploy" / "prometheus" / "tpud-alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "tpud-dashboard.json"
COLUMNS, ROWS = 120, 40


def promtool() -> str:
    found = shutil.which("promtool") or ("/usr/bin/promtool" if os.path.exists("/usr/bin/promtool") else None)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("promtool is missing (Debian: apt-get install prometheus); CI is set, so this is an error")
    pytest.skip("promtool is missing (Debian: apt-get install prometheus)")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of the shipped dashboard."""
    model = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in model["panels"] for target in panel["targets"]]


def concrete(expr: str, job: str) -> str:
    """A dashboard query as Grafana sends it: variables replaced (a scrape every second here)."""
    return expr.replace("$job", job).replace("$instance", ".*").replace("$__rate_interval", "1m")


# --- alerts ---------------------------------------------------------------------------------


def test_the_alert_rules_pass_promtool_check_and_their_unit_tests():
    tool = promtool()
    checked = subprocess.run([tool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([tool, "test", "rules", "tpud-alerts.test.yml"], cwd=ALERTS.parent,
                            capture_output=True, text=True)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_alert_has_a_summary_a_runbook_in_the_monitoring_guide_and_a_unit_test():
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    tests = (ALERTS.parent / "tpud-alerts.test.yml").read_text()
    readme = (REPO / "docs" / "monitoring.md").read_text()
    assert len(rules) >= 9
    for rule in rules:
        name = rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["runbook"] == f"docs/monitoring.md#alerts: {name}"
        assert re.search(rf"^\| `{name}` \|.+\|.+\|$", readme, re.MULTILINE), f"no runbook line for {name}"
        assert f"alertname: {name}\n" in tests, f"no promtool test of {name}"


# --- the dashboard ----------------------------------------------------------------------------


def test_the_dashboard_is_an_importable_model_with_datasource_and_job_variables():
    model = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["type"] == "query" and "tpud_job_state" in variables["job"]["definition"]
    assert "id" not in model  # an import creates its own
    titles = [panel["title"] for panel in model["panels"]]
    for wanted in ("Job state", "Steps per second", "Tokens per second", "Training loss", "Validation loss",
                   "MFU, and useful MFU", "Goodput", "Badput by kind", "Checkpoint duration (p50, p95)",
                   "Checkpoint failures per tier", "Restarts by reason", "Preemption notices", "Heartbeat age",
                   "Auto checkpoint interval per tier", "Auto checkpoint cost and expected loss",
                   "Assumed disruptions per hour"):
        assert wanted in titles
    for panel in model["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
        if panel["title"] != "Preemption notices":  # a notice concerns the host, not a job
            assert all('job=~"$job"' in t["expr"] for t in panel["targets"]), panel["title"]
    quantiles = [t["expr"] for p in model["panels"] if p["title"].startswith("Checkpoint duration")
                 for t in p["targets"]]
    assert [q.split(",")[0] for q in quantiles] == ["histogram_quantile(0.5", "histogram_quantile(0.95"]


# --- a real run: the live view, the summary, and every dashboard query with data ------------------


def hear_ctrl_c() -> None:
    """In the child: Ctrl-C's default action, which a runner started in the background (`cmd &`
    in a script) passes down as ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """A command under a pseudo-terminal, its screen kept as a terminal would draw it."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.screen = pyte.Screen(COLUMNS, ROWS)
        self.stream = pyte.ByteStream(self.screen)
        self.raw = b""
        self.child = pexpect.spawn(args[0], args[1:], cwd=str(REPO), dimensions=(ROWS, COLUMNS),
                                   env={**env, "TERM": "xterm-256color", "COLUMNS": str(COLUMNS)},
                                   preexec_fn=hear_ctrl_c)

    def pump(self, seconds: float = 0.2) -> bool:
        """Read what arrived within `seconds`; False once the program has ended."""
        try:
            data = self.child.read_nonblocking(1 << 16, timeout=seconds)
        except pexpect.TIMEOUT:
            return True
        except pexpect.EOF:
            return False
        self.raw += data
        self.stream.feed(data)
        return True

    def text(self) -> str:
        return "\n".join(line.rstrip() for line in self.screen.display).rstrip()

    def wait_for(self, pattern: str, what: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = self.pump()
            if found := re.search(pattern, self.text(), re.MULTILINE):
                return found
            if not alive:
                break
        raise AssertionError(f"timed out waiting for {what}; the screen:\n{self.text()}")

    def finish(self, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while self.pump() and time.monotonic() < deadline:
            pass
        self.child.close()
        return self.child.exitstatus


@pytest.fixture
def dataset(tmp_path) -> Path:
    from engine.prepare.pipeline import prepare
    from engine.prepare.options import Options
    from testkit import corpus

    source = corpus.write(tmp_path / "docs.jsonl", corpus.docstrings(200), "jsonl")
    out = tmp_path / "dataset"
    prepare(Options(inputs=(str(source),), tokenizer="bytes", out=str(out), val_fraction=0.1, workers=1,
                    work_dir=str(tmp_path / "work"), progress=False))
    return out


@pytest.mark.slow
def test_tpud_run_on_a_terminal_draws_a_live_view_every_dashboard_query_has_data_and_it_ends_with_a_summary(
        tmp_path, dataset, prometheus):  # noqa: F811
    job = write(tmp_path, "view.yaml", f"""\
        name: view
        include: {REPO}/configs/jobs/tiny-cpu.yaml
        model: {{vocab_size: 264}}
        data: {{dataset: {dataset}, seq_len: 64, micro_batch_size: 4}}
        train: {{max_steps: 100000, log_interval: 5}}
        scheduler: {{warmup_steps: 1}}
        eval: {{interval_steps: 10, batches: 2}}
        device: {{peak_flops: 1.0e+11}}
        checkpoint: {{interval_steps: 20}}
        """)
    home = tmp_path / "home"
    term = Terminal([PYTHON, "-m", "tpud", "run", str(job), "--home", str(home)], python_env())
    # The panel: redrawn in place (one header line however long it runs), with every figure.
    term.wait_for(r"^checkpoints  local \d+ \(\d+s ago\)", "a local checkpoint in the panel")
    first = int(term.wait_for(r"^view  RUNNING  step (\d+)/100000", "the running panel").group(1))
    term.wait_for(r"val loss \d", "a validation loss")
    screen = term.text()
    assert re.search(r"loss \d\S* \(best \d\S*\)", screen) and re.search(r"tokens/s \d", screen), screen
    assert re.search(r"MFU \d+\.\d%", screen) and re.search(r"remaining \d+:\d\d:\d\d", screen), screen
    assert "memory " in screen and "goodput " in screen and "━" in screen, screen
    address = (Paths.resolve(home).runtime / "metrics.addr").read_text().strip()
    assert f"metrics      http://{address}/metrics" in screen, screen
    term.wait_for(rf"^view  RUNNING  step (?!{first}/)\d+/100000", "the panel redrawn with a later step")
    assert term.text().count("view  RUNNING") == 1, term.text()
    assert '"event"' not in term.text()  # no JSON step lines scroll: the panel says it

    # Every dashboard query answers with data from this run, scraped by a real Prometheus.
    server = prometheus([address])
    for title, expr in dashboard_queries():
        server.wait_for(concrete(expr, "view"), lambda samples: len(samples) > 0 and all(
            s.value == s.value for s in samples), timeout=60)  # a NaN is no data either

    # Ctrl-C: the job checkpoints and stops; the summary tells what happened and how to go on.
    term.child.sendintr()
    assert term.finish() == 75
    summary = term.text()
    assert re.search(r"^job +view: STOPPED \(exit 75\)", summary, re.MULTILINE), summary
    for pattern in (r"^steps +\d+/100000, \d+ in this run", r"^tokens +[\d,]+ in this run", r"^wall time +0:\d\d:\d\d",
                    r"^loss +final \d\S*, best \d", r"^val loss +final \d\S* at step \d+, best \d",
                    r"^goodput +\d+\.\d%; badput startup", r"^restarts +0",
                    r"^checkpoint \(local\) +step \d+", rf"^resume +tpud run {re.escape(str(job))}",
                    rf"^export +tpud export {re.escape(str(job))} OUT_DIR"):
        assert re.search(pattern, summary, re.MULTILINE), f"{pattern} not in\n{summary}"


def test_a_worker_warning_scrolls_above_the_panel_as_one_readable_line():
    from rich.console import Console

    from tpud.view.live import LiveView

    console = Console(file=open(os.devnull, "w"), record=True, width=COLUMNS, force_terminal=True)
    view = LiveView("job.yaml", console=console)
    view.relay(b'{"event": "step", "step": 3, "loss": 2.5, "tokens_per_s": 100.0, "step_time_s": 0.5, '
               b'"level": "info", "timestamp": "2026-11-23T10:00:00Z"}\n{"event": "checkpoint failed", '
               b'"error": "No space left on device", "level": "warn')
    view.relay(b'ing", "timestamp": "2026-11-23T10:00:01Z"}\nTraceback (most recent call last):\n')
    shown = console.export_text()
    assert shown.splitlines() == [
        "10:00:01 warning checkpoint failed  error=No space left on device",
        "Traceback (most recent call last):",
    ]
    # A line stands for every step since the last (3 steps of 50 tokens), and a restart redoes
    # the steps after its restore.
    assert view.history.best_loss == 2.5 and view.history.tokens == 150.0
    view.relay(b'{"event": "checkpoint restored", "step": 2, "level": "info"}\n'
               b'{"event": "step", "step": 4, "loss": 2.0, "tokens_per_s": 100.0, "step_time_s": 0.5, "level": "info"}\n')
    assert view.history.tokens == 250.0 and view.history.best_loss == 2.0 and view.history.resumed_from is None


# --- tpud status --watch ------------------------------------------------------------------------


@pytest.mark.slow
def test_status_watch_redraws_the_table_in_place_until_ctrl_c(tmp_path):
    home = tmp_path / "home"
    (home / "jobs.d").mkdir(parents=True)
    (home / "jobs.d" / "watched.yaml").write_text(job_text("watched"))
    daemon = Daemon(home)
    try:
        daemon.wait_for(lambda jobs: (jobs.get("watched") or {}).get("step"), "a step")
        term = Terminal([PYTHON, "-m", "tpud", "status", "--home", str(home), "--watch", "0.5"], python_env())
        first = int(term.wait_for(r"^watched +RUNNING +(\d+)/100000", "the table").group(1))
        term.wait_for(rf"^watched +RUNNING +(?!{first}/)\d+/100000", "the table redrawn with a later step")
        screen = term.text()
        assert screen.startswith("every 0.5s: tpud status") and screen.count("JOB  ") == 1, screen
        term.child.sendintr()
        assert term.finish(timeout=20) == 0
    finally:
        daemon.proc.terminate()
        daemon.proc.wait(timeout=120)


def test_status_watch_shows_an_unreachable_daemon_and_keeps_watching(tmp_path):
    term = Terminal([PYTHON, "-m", "tpud", "status", "--home", str(tmp_path / "nowhere"), "-w", "0.2"],
                    python_env())
    term.wait_for(r"the daemon may not be running", "the error on screen", timeout=30)
    term.wait_for(r"^every 0.2s: tpud status +\d\d:\d\d:\d\d", "the header", timeout=10)
    assert term.child.isalive()
    term.child.sendintr()
    assert term.finish(timeout=20) == 0


def test_status_watch_piped_prints_one_screen_after_another_and_json_with_o_json(tmp_path):
    home = tmp_path / "home"
    (home / "jobs.d").mkdir(parents=True)
    daemon = Daemon(home)
    try:
        wait_until(lambda: daemon.cli("status").returncode == 0, "the daemon answering", timeout=60)
        proc = subprocess.Popen([PYTHON, "-m", "tpud", "status", "-o", "json", "--watch", "0.2", "--home", str(home)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(),
                                preexec_fn=hear_ctrl_c)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if sum(x.startswith("every 0.2s: tpud status") for x in lines) == 3:
                break
        proc.send_signal(2)  # Ctrl-C
        proc.communicate(timeout=20)
        assert proc.returncode == 0
        assert sum(x.startswith('  "jobs": []') for x in lines) >= 2, lines
        head = subprocess.run(f"{PYTHON} -m tpud status -w 0.1 --home {home} | head -1", shell=True, env=python_env(),
                              capture_output=True, text=True, timeout=60)
        assert head.stdout.startswith("every 0.1s") and "Error" not in head.stderr, head.stderr
    finally:
        daemon.proc.terminate()
        daemon.proc.wait(timeout=120)


@pytest.mark.parametrize("argv, interval, jobs", [
    (["--watch"], 2.0, []), (["--watch", "5"], 5.0, []), (["-w", "0.5", "a"], 0.5, ["a"]),
    (["--watch", "a", "b"], 2.0, ["a", "b"]), (["a", "--watch"], 2.0, ["a"]), ([], None, []),
])
def test_watch_takes_seconds_or_leaves_a_job_name_alone(argv, interval, jobs):
    from tpud.cli import parse_args
    from tpud.commands.control import watch_interval as _watch_interval

    assert _watch_interval(parse_args(["status", *argv])) == (interval, jobs)


def test_watch_refuses_an_interval_out_of_range(capsys):
    from tpud.cli import main

    with pytest.raises(SystemExit, match="between 0.1 and 86400"):
        main(["status", "--watch", "0"])


def test_the_summary_gives_commands_that_paste_into_a_shell_and_names_this_runs_restarts():
    from rich.console import Console

    from tpud.view.summary import History, render

    console = Console(file=open(os.devnull, "w"), record=True, width=COLUMNS)
    job = {"name": "j", "state": "FAILED", "step": 5, "max_steps": 10, "restarts": 3,
           "restart_reasons": {"oom": 1}, "error": "exited with status 1 (boom)\ntraceback",
           "checkpoints": {"gcs": {"step": 4, "age_seconds": 30}}}
    console.print(render(job, History(), 12, "my jobs/a b.yaml", 1))
    shown = [line.rstrip() for line in console.export_text().splitlines()]
    assert "resume            tpud run 'my jobs/a b.yaml'" in shown
    assert "export            tpud export 'my jobs/a b.yaml' OUT_DIR --tier gcs" in shown  # no local tier
    assert "restarts          3 (this run: oom 1)" in shown and "error             exited with status 1 (boom)" in shown
