"""Tools around the app: the feddifrc CLI, sweeps, reports, run-config helpers."""
