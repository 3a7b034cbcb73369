"""The equivalence layer: parity, goldens, stats, mutation and memory checks for autoparallel."""
