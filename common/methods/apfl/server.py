"""APFL's server is FedAvg's: the global model w, the sample-weighted average of the replies' (the
local models and mixing weights never leave the sites)."""

from common.methods.server import ServerPart as Server

__all__ = ["Server"]
