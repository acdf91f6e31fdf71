"""The code behind tpud's subcommands (tpud/cli.py only builds the parser and dispatches): each
module is imported when its command runs, so `tpud --help` stays light.

    run.py daemon.py     `tpud run`, `tpud daemon`      control.py  status (--watch), checkpoint-now, stop, start
    validate.py          `tpud validate`                 checkpoints.py  `tpud checkpoints`
    export.py profile.py `tpud export`, `tpud profile`
    remote.py            `tpud submit`, `tpud cancel`    install_service.py  `tpud install-service`
"""

# Client exit codes (docs/architecture.md, "Exit codes").
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # argparse exits with 2 on its own
EXIT_JOB_UNKNOWN = 3
EXIT_DAEMON_UNREACHABLE = 4
