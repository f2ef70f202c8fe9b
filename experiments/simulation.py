"""One experiment cell as a Flower simulation: ``python -m experiments.simulation``.

The runner starts this module in a fresh process per cell, so that every cell gets its own Ray
instance and memory, and a crashing cell cannot take the grid down. It runs the project's real
ServerApp and ClientApp on Flower's Simulation Runtime (``flwr.simulation.run_simulation``,
Ray backend), with no SuperLink to start, share or stop. That API takes no run config, so both
apps are wrapped to hand the cell's run config to the project's apps through their
``Context``, exactly where ``flwr run --run-config`` would put it; keys not given take the
defaults of ``common.config`` (the same as pyproject.toml's, which a test checks).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.config import parse_config_args
from flwr.serverapp import Grid, ServerApp

from client_app.app import app as project_client_app
from common.config import parse_run_config
from server_app import simulation_engine
from server_app.app import main as project_server_main


def make_apps(run_config: dict[str, Any], node_config: dict[str, Any] | None = None) -> tuple[ServerApp, ClientApp]:
    """The project's ServerApp and ClientApp, each seeing ``run_config`` as its run config; every
    simulated site's node config also holds ``node_config`` (a site's own settings, such as
    ``state-dir``: where the cell's sites keep their state and privacy ledgers)."""
    node_config = dict(node_config or {})
    parse_run_config(run_config)  # a bad cell fails here, before Ray starts
    server_app = ServerApp()
    client_app = ClientApp()

    @server_app.main()
    def _server(grid: Grid, context: Context) -> None:
        context.run_config = dict(run_config)
        project_server_main(grid, context)

    def _client(msg: Message, context: Context) -> Message:
        # The node's Context refuses a new run config; the app gets a view with the cell's.
        view = Context(run_id=context.run_id, node_id=context.node_id,
                       node_config={**node_config, **context.node_config}, state=context.state,
                       run_config=dict(run_config))
        return project_client_app(msg, view)

    client_app.train()(_client)
    client_app.evaluate()(_client)
    client_app.query()(_client)
    return server_app, client_app


def run_cell(run_config: dict[str, Any], clients: int, cpus_per_client: float = 1.0,  # pylint: disable=too-many-arguments
             gpus_per_client: float = 0.0, node_config: dict[str, Any] | None = None) -> None:
    """Run one cell to completion on ``clients`` simulated SuperNodes (raises if it fails)."""
    from flwr.simulation import run_simulation  # pylint: disable=import-outside-toplevel

    simulation_engine.install()
    # A Ray of the cell's own unless told otherwise: plain ray.init() joins the last `ray start`
    # of this host, whose workers may not run this checkout's code.
    os.environ.setdefault("RAY_ADDRESS", "local")
    server_app, client_app = make_apps(run_config, node_config)
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=clients,
        backend_config={"client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client}},
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-config", required=True, help="the cell's run config, as a JSON object")
    parser.add_argument("--clients", type=int, required=True, help="number of simulated SuperNodes")
    parser.add_argument("--cpus-per-client", type=float, default=1.0)
    parser.add_argument("--gpus-per-client", type=float, default=0.0)
    parser.add_argument("--node-config", default="",
                        help="every simulated site's own settings, as flower-supernode takes them: "
                             "\"state-dir='DIR' dp-noise-secret='HEX'\"")
    args = parser.parse_args(argv)
    # The runner stops a cell with SIGINT first (Ray shuts down cleanly): take it even when this
    # process inherited it ignored (a runner started in the background by a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    node_config = parse_config_args([args.node_config]) if args.node_config else {}
    run_cell(json.loads(args.run_config), args.clients, args.cpus_per_client, args.gpus_per_client, node_config)


if __name__ == "__main__":
    main()
