"""The switch from Flower, measured: the same PyTorch CNN (Flower's quickstart network for one
28×28 channel), the same MNIST partition, the same local SGD and the same initial weights,
federated by FedAvg with Flower 1.x (NumPyClient + ClientApp, under its simulation engine or its
deployment engine) or with Starling's Python SDK against the coordinator on Postgres.

    python bench.py --side starling|flower-sim|flower-deploy --clients N --rounds R --out result.json

Per round: seconds (round start to its aggregate), model bytes moved (the parameters each side
sends down and up, as serialized), and the test accuracy of the round's model, evaluated after
the run on MNIST's 10 000 test images so that evaluation never counts as round time.
Peak resident memory is of the whole process tree (sampled every 0.5 s). `vs_flower.sh` runs
the matrix and prints the table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))
import support  # noqa: E402

# Local training as Flower's PyTorch quickstart does it (SGD with momentum 0.9), one epoch.
EPOCHS, BATCH, LR, MOMENTUM, PER_CLIENT = 1, 16, 0.05, 0.9, 600
torch.set_num_threads(1)


def initial_net() -> support.Net:
    torch.manual_seed(0)
    return support.Net()


def shard(partition: int, clients: int):
    x, y = support.mnist("train")
    index = support.iid_partition(len(x), clients, PER_CLIENT, seed=7)[partition]
    return x[index], y[index]


def accuracies(states: list[dict[str, torch.Tensor]]) -> list[float]:
    tx, ty = support.mnist("t10k")
    return [support.accuracy(state, tx, ty) for state in states]


# ---------------------------------------------------------------- Starling ----------------------


def play_devices(url: str, token: str, run_id: int, devices, clients: int, operator_token: str) -> None:
    """Devices `devices` of the partition into `clients` shards, each training its own copy of
    the network with the shared loop, until the run finishes."""
    import starling_client as sc

    trainers = [support.torch_trainer(*shard(k, clients), momentum=MOMENTUM).train for k in devices]
    operator = sc.Operator(url, operator_token)
    sc.simulate(url, "default", token, trainers, operator=operator, run_id=run_id, timeout_secs=3600)


def run_starling(clients: int, rounds: int, database_url: str | None, processes: int) -> dict:
    import starling_client as sc
    from starling_client.torch import model_section

    coordinator = support.Coordinator(database_url=database_url)
    try:
        operator = sc.Operator(coordinator.url, support.OPERATOR_TOKEN)
        start = initial_net()
        base = operator.import_base_model("bench-init", support.save_safetensors(start.state_dict()))
        plan = {
            "model": model_section(start, init={"kind": "base_model", "hash": base["content_hash"]}),
            "training": {"epochs": EPOCHS, "batch_size": BATCH, "lr": LR},
            "cohort_size": clients, "over_selection": 1.0, "min_quorum": clients, "rounds": rounds,
            "selection_timeout_secs": 60.0, "reporting_timeout_secs": 600.0,
        }
        run = operator.create_run(plan)
        token = operator.enrollment_token(clients)
        began = time.monotonic()
        if processes == 1:
            play_devices(coordinator.url, token, run["id"], range(clients), clients, support.OPERATOR_TOKEN)
        else:
            # Like Flower's Ray actors: each process plays its share of the devices, so their
            # Python training loops do not share one interpreter lock.
            shares = [range(k, clients, processes) for k in range(processes)]
            children = [subprocess.Popen([sys.executable, __file__, "--side", "starling-devices", "--url", coordinator.url,
                                          "--token", token, "--run", str(run["id"]), "--clients", str(clients),
                                          "--operator-token", support.OPERATOR_TOKEN,
                                          "--devices", ",".join(map(str, share)), "--out", os.devnull])
                        for share in shares]
            for child in children:
                if child.wait() != 0:
                    raise RuntimeError(f"a device process failed: {child.args}")
        wall = time.monotonic() - began
        views = operator.rounds(run["id"])
        committed = [r for r in views if r["state"] == "committed"]
        download = len(operator.export_model(run["id"], 0, format="payload"))
        per_round = []
        for r in committed:
            per_round.append({
                "round": r["round_idx"] + 1,
                "seconds": (r["closed_at_ms"] - r["opened_at_ms"]) / 1000,
                "bytes_down": download * r["n_selected"],
                "bytes_up": r["upload_bytes"],
            })
        states = [support.load_safetensors(operator.export_model(run["id"], v)) for v in range(len(committed) + 1)]
        return {"wall_seconds": wall, "rounds": per_round, "accuracy": accuracies(states)}
    finally:
        coordinator.close()


# ---------------------------------------------------------------- Flower ------------------------


def flower_apps(clients: int, rounds: int, log_dir: str):
    """Flower's quickstart shape: a NumPyClient in a ClientApp, FedAvg in a ServerApp; the
    strategy logs each round's start, end and parameter bytes, and saves each round's model."""
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg

    names = list(initial_net().state_dict().keys())

    def get_weights(net):
        return [v.detach().cpu().numpy() for v in net.state_dict().values()]

    def set_weights(net, arrays):
        net.load_state_dict({n: torch.from_numpy(np.copy(a)) for n, a in zip(names, arrays)}, strict=True)

    class TorchClient(NumPyClient):
        def __init__(self, partition: int) -> None:
            self.x, self.y = shard(partition, clients)
            self.partition = partition
            self.net = support.Net()

        def fit(self, parameters, config):
            set_weights(self.net, parameters)
            examples, loss = support.fit(self.net, self.x, self.y, epochs=EPOCHS, batch_size=BATCH, lr=LR,
                                         seed=int(config["round"]) * 100_003 + self.partition, momentum=MOMENTUM)
            return get_weights(self.net), examples, {"loss": loss}

    def client_fn(context):
        return TorchClient(int(context.node_config["partition-id"])).to_client()

    class TimedFedAvg(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            self.started = time.time()
            instructions = super().configure_fit(server_round, parameters, client_manager)
            self.down = sum(len(t) for _, ins in instructions for t in ins.parameters.tensors)
            return instructions

        def aggregate_fit(self, server_round, results, failures):
            aggregated, metrics = super().aggregate_fit(server_round, results, failures)
            ended = time.time()
            up = sum(len(t) for _, res in results for t in res.parameters.tensors)
            arrays = parameters_to_ndarrays(aggregated)
            np.savez(os.path.join(log_dir, f"round-{server_round}.npz"), *arrays)
            with open(os.path.join(log_dir, "rounds.jsonl"), "a") as log:
                log.write(json.dumps({"round": server_round, "started": self.started, "ended": ended,
                                      "bytes_down": self.down, "bytes_up": up, "results": len(results),
                                      "failures": len(failures)}) + "\n")
            return aggregated, metrics

    def server_fn(context):
        strategy = TimedFedAvg(
            fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=clients, min_evaluate_clients=0,
            min_available_clients=clients, on_fit_config_fn=lambda r: {"round": r},
            initial_parameters=ndarrays_to_parameters(get_weights(initial_net())),
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    return ServerApp(server_fn=server_fn), ClientApp(client_fn=client_fn), names


def flower_result(log_dir: str, names: list[str], wall: float) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "rounds.jsonl"))]
    states = [initial_net().state_dict()]
    for row in rows:
        arrays = np.load(os.path.join(log_dir, f"round-{row['round']}.npz"))
        states.append({n: torch.from_numpy(arrays[f"arr_{i}"]) for i, n in enumerate(names)})
    per_round = [{"round": r["round"], "seconds": r["ended"] - r["started"], "bytes_down": r["bytes_down"],
                  "bytes_up": r["bytes_up"], "failures": r["failures"]} for r in rows]
    return {"wall_seconds": wall, "rounds": per_round, "accuracy": accuracies(states)}


def run_flower_simulation(clients: int, rounds: int) -> dict:
    from flwr.simulation import run_simulation

    with tempfile.TemporaryDirectory() as log_dir:
        server_app, client_app, names = flower_apps(clients, rounds, log_dir)
        cpus = os.cpu_count() or 2
        began = time.monotonic()
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=clients,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": cpus, "include_dashboard": False}})
        wall = time.monotonic() - began
        return flower_result(log_dir, names, wall)


def tree_rss_mib(root: int) -> float:
    """Resident memory of `root` and every process under it (the coordinator, Ray's workers,
    Flower's SuperLink, SuperNodes and apps), sampled now."""
    total, seen, frontier = 0, set(), [root]
    while frontier:
        pid = frontier.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in os.listdir(f"/proc/{pid}/task"):
                frontier.extend(int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split())
        except OSError:
            pass
    return total / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=["starling", "flower-sim", "flower-deploy", "starling-devices"], required=True)
    parser.add_argument("--processes", type=int, default=1, help="Starling: device processes")
    parser.add_argument("--url")
    parser.add_argument("--token")
    parser.add_argument("--run", type=int)
    parser.add_argument("--devices")
    parser.add_argument("--operator-token")
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--database-url")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.side == "starling-devices":
        devices = [int(d) for d in args.devices.split(",")]
        play_devices(args.url, args.token, args.run, devices, args.clients, args.operator_token)
        return
    peak, done = [0.0], threading.Event()

    def sample():
        while not done.wait(0.5):
            peak[0] = max(peak[0], tree_rss_mib(os.getpid()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if args.side == "starling":
        result = run_starling(args.clients, args.rounds, args.database_url, args.processes)
    elif args.side == "flower-sim":
        result = run_flower_simulation(args.clients, args.rounds)
    else:
        import deploy

        result = deploy.run(args.clients, args.rounds)
    done.set()
    side = args.side if args.processes == 1 else f"{args.side} ({args.processes} device processes)"
    result.update({"side": side, "clients": args.clients, "rounds_planned": args.rounds,
                   "peak_rss_mib": peak[0]})
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
