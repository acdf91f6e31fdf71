"""From a bare VM to a running daemon: `tpud install-service` (install.py) and the unit it writes (tpud.service)."""
