"""What runs: named scenarios through ``autoparallel.pipeline``, the graph trainer's stages and
the planning cases."""
