"""The baselines' server: each part of the model averaged over the replies by sample count
(eq. 18) or kept per client, as the method's rules say (``common.methods.server.ServerPart``)."""

from common.methods.server import ServerPart as Server

__all__ = ["Server"]
