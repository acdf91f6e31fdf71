"""The code behind tpud's subcommands that is more than a call into another package (tpud/cli.py
only builds the parser and dispatches): imported when its command runs, so `tpud --help` stays light."""
