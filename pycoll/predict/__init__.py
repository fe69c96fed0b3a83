"""`pycoll predict`'s model: a recorded training workload (workload.py) replayed on a target cluster
with the tuner's prices of its gradient allreduces (model.py)."""
