"""Loading a checkpoint into a model: `load`, its report, the memory budget, expert parallelism."""
