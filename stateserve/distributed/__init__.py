"""Tensor parallelism on torch.distributed (docs/distributed.md): the gloo group (group.py), the split rules that
share a model's layers out over ranks (sharding.py, rules_*.py), rank 0's runner that leads the others (driver.py)
and the worker processes (worker.py)."""
