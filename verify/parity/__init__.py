"""Running the graphs for real and comparing: tensors bitwise and against the oracle, gloo worlds
per executor, planned worlds, the graph trainer's stages, simulated ranks (differential
execution) and the launcher."""
