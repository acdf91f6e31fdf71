"""engine: the SPMD training core (data plane). Never imports tpud."""
