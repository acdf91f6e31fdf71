"""tpud: the fault-tolerant training daemon (control plane). Never imports torch."""

__version__ = "0.1.0"
