"""Ditto's server is FedAvg's: the global model, the sample-weighted average of the replies' (the
personal models never leave the sites)."""

from common.methods.server import ServerPart as Server

__all__ = ["Server"]
