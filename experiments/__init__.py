"""Experiment grids: FedPAC against its baselines, methods x settings x seeds (``fedpac-experiments``)."""
