"""Hyperparameter sweeps: grid or random search over a training module's declared
`HYPERPARAMETERS`, trials submitted as tasks K at a time, placed by a plan's performance
model, bad trials stopped by the median rule (docs/architecture.md, "Sweeps")."""
