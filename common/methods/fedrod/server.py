"""Fed-RoD's server is FedAvg's: the sample-weighted average of the replies' generic models
(extractor and generic head; the personal heads never leave the sites)."""

from common.methods.server import ServerPart as Server

__all__ = ["Server"]
