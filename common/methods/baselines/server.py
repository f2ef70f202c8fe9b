"""The baselines' server: each part of the model averaged over the replies by sample count
(eq. 18) or kept per client, as the method's rules say (``common.methods.server.ServerPart``)."""

from common.methods.outputs import Outputs, reply_metric
from common.methods.server import ServerPart


class Server(ServerPart):
    """The base server part; FedRep's clients report their head's loss (``clients.csv``)."""

    outputs = Outputs(client_columns=(reply_metric("head_loss", "head-loss"),))


__all__ = ["Server"]
