"""What runs: named scenarios through ``autoparallel.pipeline``, the planning cases, the default
scenario, and how each stage is verified (``registry``)."""
