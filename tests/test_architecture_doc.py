"""docs/architecture.md and the code agree, where a machine can tell: the settings tables are
what the schemas generate, and every metric, exit code, channel message and field, CLI command
and option, restart reason, badput kind, job state and state-directory path is documented (and
no metric is documented that the daemon does not have). Also: no file of the repository refers
to a path outside it, as the design once lived outside."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from engine import events, exit_codes
from engine.checkpoint import hosts as checkpoint_hosts
from engine.checkpoint import manifest
from engine.layout import StateLayout
from tpud import cli
from tpud.job import goodput
from tpud.job.health import crashes
from tpud.job.states import State
from tpud.metrics.series import NOTICE_SOURCES, Metrics
from tpud.paths import Paths

REPO = Path(__file__).resolve().parents[1]
DOC_PATH = REPO / "docs" / "architecture.md"
DOC = DOC_PATH.read_text()


def section(title: str) -> str:
    """The text of `## title`, up to the next section of that level."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", DOC, re.MULTILINE | re.DOTALL)
    assert match, f"docs/architecture.md has no section '## {title}'"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The cells of every table row in `text` (header and rule rows included)."""
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            for line in text.splitlines() if line.startswith("|")]


def ticked(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def test_the_settings_tables_are_what_the_schemas_generate():
    spec = importlib.util.spec_from_file_location("settings_tables", REPO / "docs" / "settings_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    assert DOC.count("<!-- settings: ") == 2, "the job and tpud.yaml tables"
    assert tables.render(DOC) == DOC, "run `python docs/settings_tables.py --write` and commit the result"


def registered_metrics() -> set[str]:
    metrics = Metrics()
    try:
        text = metrics.exposition().decode()  # as served
    finally:
        metrics.close()
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))


def test_every_metric_is_documented_and_every_documented_metric_exists():
    rows = table_rows(section("Metrics"))
    documented = {name for row in rows for name in ticked(row[0]) if name.startswith("tpud_")}
    assert documented == registered_metrics()
    mentioned = set(re.findall(r"\btpud_[a-z_]+", DOC))
    assert mentioned <= documented, f"named but not a metric: {sorted(mentioned - documented)}"


def metric_labels() -> dict[str, set[str]]:
    """Each metric's label names: as declared, and as a heartbeat's series shows them (computed at scrape)."""
    metrics = Metrics()
    try:
        metrics.heartbeat("j", 0.0)
        labels: dict[str, set[str]] = {}
        for value in vars(metrics).values():
            if isinstance(value, MetricWrapperBase):
                for family in value.describe():
                    name = family.name + ("_total" if family.type == "counter" else "")
                    labels[name] = set(value._labelnames)
        for name, inside in re.findall(r"^(tpud_\w+)\{(.*)\} ", metrics.exposition().decode(), re.MULTILINE):
            labels.setdefault(name, set()).update(re.findall(r'(\w+)="', inside))
        return labels
    finally:
        metrics.close()


def test_every_metric_label_is_documented():
    rows = {name: row for row in table_rows(section("Metrics")) for name in ticked(row[0])}
    labels = metric_labels()
    assert set(labels) == registered_metrics()
    for name, names in labels.items():
        assert ticked(rows[name][1]) == names - {"le"}, name


@pytest.mark.parametrize("module, prefix", [(exit_codes, ""), (cli, "EXIT_")])
def test_every_exit_code_has_a_row(module, prefix):
    codes = {name: value for name, value in vars(module).items()
             if name.isupper() and name.startswith(prefix) and isinstance(value, int)}
    assert codes
    rows = table_rows(section("Exit codes"))
    for name, value in codes.items():
        assert [str(value), f"`{name}`"] in [row[:2] for row in rows], f"{value} {name}"


def test_every_channel_message_and_field_is_documented():
    rows = {next(iter(ticked(row[0])), ""): row for row in table_rows(section("The worker channel"))}
    for cls in (*events.WORKER_EVENTS, events.CheckpointRequest):
        assert cls.TYPE in rows, f"message {cls.TYPE!r}"
        fields = {f.name for f in dataclasses.fields(cls)}
        assert ticked(rows[cls.TYPE][1]) == fields, cls.TYPE
    channel = section("The worker channel")
    for kind in events.BADPUT_KINDS:
        assert f"`{kind}`" in channel, kind
    actions = events.CheckpointRequest.__pydantic_fields__["action"].annotation  # the enum, wherever it lives
    for action in actions:
        assert f"`{action.value}`" in channel, action


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subparsers.choices)


def test_every_command_and_option_is_documented():
    text = section("Command line")
    synopses = [row[0] for row in table_rows(text)]
    for name, parser in subcommands().items():
        matching = [s for s in synopses if re.match(rf"`tpud {re.escape(name)}[ `]", s)]
        assert len(matching) == 1, f"`tpud {name}` has no row (or several)"
        for action in parser._actions:
            strings = [s for s in action.option_strings if s not in ("-h", "--help", "--home")]
            if strings:
                assert any(re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", matching[0]) for s in strings), \
                    f"tpud {name} {'/'.join(strings)}"
    for option in ("--home", "--version"):
        assert f"`{option}`" in text


def test_restart_reasons_badput_kinds_states_and_notice_sources_are_named():
    for word in (*crashes.REASONS, *goodput.KINDS, *NOTICE_SOURCES):
        assert f"`{word}`" in DOC, word
    lifecycle = section("Job lifecycle")
    for state in State:
        assert state.value in lifecycle, state


def test_the_state_directory_paths_are_documented():
    layout = StateLayout(Path("<state>"))
    job = "<job>"
    paths = [layout.record_file(job), layout.spec_file(job), layout.skips_file(job), layout.xla_cache(job),
             layout.inductor_cache(job), layout.datasets(), layout.models(), layout.checkpoints(job)]
    home = Paths(config=Path("<config>"), state=Path("<state>"), runtime=Path("<runtime>"))
    paths += [home.jobs_dir, home.channel(job)]
    text = section("State directory")
    for path in paths:
        assert str(path) in text, path
    checkpoints = section("Checkpoints")
    for name in (manifest.MANIFEST, manifest.GLOBAL, manifest.PINS, checkpoint_hosts.HELD):
        assert name in checkpoints, name
    for field in dataclasses.fields(manifest.Manifest):
        assert f"`{field.name}`" in checkpoints, field.name


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in listed.decode().split("\0") if name]


def test_no_file_refers_outside_the_repository():
    # Spelled in pieces, so this file does not name them itself.
    outside = re.compile("|".join(re.escape(p) for p in ("../" + "shared", "DESIGN" + ".md", "/" + "work/")))
    found = []
    for path in tracked_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        found += [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
                  for m in outside.finditer(text)]
    assert not found, "\n".join(found)


def test_the_readme_links_to_the_design():
    assert "(docs/architecture.md)" in (REPO / "README.md").read_text()
