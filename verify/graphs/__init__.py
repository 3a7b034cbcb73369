"""Reading graphs without running them: canonical text, statistics, memory, invariants, the plan's
static checks, and generated graphs for the property tests."""
