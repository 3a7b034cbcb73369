"""autoparallel: model -> per-rank joint graph with explicit collectives -> graph passes -> execution."""

__version__ = "0.1.0"
