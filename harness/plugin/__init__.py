"""The pytest plugin: the pytest11 entry point, the target's lifecycle, results, the check
functions and the built-in suite."""
