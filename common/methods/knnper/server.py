"""kNN-Per's server is FedAvg's: the sample-weighted average of the replies' models (the
datastores are built at the sites, from their own data, and never travel)."""

from common.methods.server import ServerPart as Server

__all__ = ["Server"]
