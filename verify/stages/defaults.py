"""The default scenario, shared by ``Scenario``, the graph trainer's stages and every
``python -m verify`` parser, in one torch-free module (the parser loads no torch)."""

PRESET, PLAN, MESH = "tiny", "fsdp", "dp=8"  # Scenario(), python -m verify report / bisect
TRAINER_PRESET = "debug"  # the graph trainer's stages; its goldens are of this preset
