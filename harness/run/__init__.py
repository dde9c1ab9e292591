"""Running: the option registry and its precedence merge, the output directory, workload
phases and arrivals, the runner, the one wiring that puts a run together, sessions and
progress."""
