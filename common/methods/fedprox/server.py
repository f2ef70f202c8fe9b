"""FedProx's server is FedAvg's: the sample-weighted average of the replies' models."""

from common.methods.server import ServerPart as Server

__all__ = ["Server"]
