"""The command line takes arguments in the orders people type them."""

from __future__ import annotations

import pytest

from tpud import cli, commands

COMMANDS = ["daemon", "run", "validate", "prepare", "schema", "checkpoints", "status", "checkpoint-now", "stop", "start"]


@pytest.mark.parametrize("argv", [
    ["--home", "/h", "status"],
    ["status", "--home", "/h"],
    ["--home=/h", "status", "-o", "json"],
    ["status", "-o", "json", "--home=/h", "a"],
])
def test_home_before_or_after_the_command(argv):
    assert cli.parse_args(argv).home == "/h"


def test_home_after_the_command_wins_and_none_means_default():
    assert cli.parse_args(["--home", "/a", "stop", "j", "--home", "/b"]).home == "/b"
    assert cli.parse_args(["stop", "j"]).home is None


@pytest.mark.parametrize("argv", [
    ["run", "job.yaml", "--home", "/h", "train.max_steps=60"],
    ["run", "job.yaml", "a.b=1", "--home", "/h", "train.max_steps=60"],
    ["--home", "/h", "run", "job.yaml", "a.b=1", "--metrics-addr", "127.0.0.1:0", "train.max_steps=60"],
    ["run", "--home", "/h", "job.yaml", "a.b=1", "train.max_steps=60"],
    ["run", "job.yaml", "--home", "/h", "--", "a.b=1", "train.max_steps=60"],
    ["run", "job.yaml", "--home", "/h", "a.b=1", "--", "train.max_steps=60"],
])
def test_run_takes_overrides_anywhere_after_the_job_file_in_order(argv):
    args = cli.parse_args(argv)
    assert (args.job, args.home) == ("job.yaml", "/h")
    assert args.overrides[-1] == "train.max_steps=60" and args.overrides[:-1] in ([], ["a.b=1"])


@pytest.mark.parametrize("argv", [
    ["run", "job.yaml", "--home", "/h", "stray"],      # not key=value
    ["run", "job.yaml", "--bogus", "a=1"],             # an unknown option
    ["status", "--home", "/h", "a=1", "--bogus"],
    ["--home", "/h", "status", "--bogus"],
])
def test_what_is_not_an_override_is_still_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.parse_args(argv)
    assert exit.value.code == commands.EXIT_USAGE
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "profile", "submit"])
def test_a_command_without_its_job_file_asks_for_that_alone(command, capsys):
    """Overrides are optional: Python 3.11's argparse named them required beside the job file."""
    with pytest.raises(SystemExit) as exit:
        cli.parse_args([command])
    assert exit.value.code == commands.EXIT_USAGE
    assert capsys.readouterr().err.strip().endswith("the following arguments are required: JOB.yaml")
    assert cli.parse_args([command, "job.yaml"]).overrides == []


def test_home_before_the_command_reaches_the_daemon_there(tmp_path, capsys):
    code = cli.main(["--home", str(tmp_path), "status"])
    assert code == commands.EXIT_DAEMON_UNREACHABLE
    assert f"{tmp_path}/run/control.sock" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_explains_itself_and_takes_home(command, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.parse_args([command, "--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    words = " ".join(text.split())
    assert text.startswith(f"usage: tpud {command}")
    assert "--home DIR" in words and "before or after the command name" in words
    description = text.split("\n\n")[1]
    assert len(description.split()) >= 5  # a description, not only the usage line
