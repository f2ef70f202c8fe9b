"""FedBABU's server is FedAvg's: the sample-weighted average of the replies' models. Every client
sends back the head it received, unchanged, so the average keeps the initial head, bit for bit
(``common.averaging.weighted_average`` rounds float64 sums back to the float32 inputs)."""

from common.methods.server import ServerPart as Server

__all__ = ["Server"]
