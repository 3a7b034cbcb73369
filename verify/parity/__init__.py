"""Running the graphs for real and comparing: tensors bitwise and against the oracle, gloo worlds
per executor, planned worlds, simulated ranks (differential execution) and the launcher."""
