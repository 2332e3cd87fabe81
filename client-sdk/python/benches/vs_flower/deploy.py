"""Flower's deployment engine for the comparison: a SuperLink, one SuperNode per client (each
running the ClientApp in a process of its own, as Flower deploys them) and `flwr run` of a Flower
App made from `bench.py`'s apps, all on this machine over loopback HTTP (one port: Flower 1.42 serves its Fleet, Control and ServerAppIo APIs on it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent

APP_TOML = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "starlingbench"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "starling"

[tool.flwr.app.components]
serverapp = "starlingbench.apps:server_app"
clientapp = "starlingbench.apps:client_app"

[tool.flwr.app.config]
"""

APPS_PY = """import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import bench  # noqa: E402

_apps = bench.flower_apps(
    int(os.environ["STARLING_FLWR_CLIENTS"]), int(os.environ["STARLING_FLWR_ROUNDS"]), os.environ["STARLING_FLWR_LOG"]
)
server_app = _apps[0]
client_app = _apps[1]
"""


def run(clients: int, rounds: int) -> dict:
    import bench

    work = Path(tempfile.mkdtemp(prefix="flower-deploy-"))
    log_dir = work / "log"
    log_dir.mkdir()
    app = work / "app"
    package = app / "starlingbench"
    package.mkdir(parents=True)
    (app / "pyproject.toml").write_text(APP_TOML)
    (package / "__init__.py").write_text("")
    (package / "apps.py").write_text(APPS_PY)
    shutil.copy(HERE / "bench.py", package / "bench.py")
    shutil.copy(HERE.parents[1] / "tests" / "support.py", package / "support.py")
    home = work / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:19091"\ninsecure = true\n'
    )
    env = dict(os.environ, FLWR_HOME=str(home), STARLING_FLWR_CLIENTS=str(clients),
               STARLING_FLWR_ROUNDS=str(rounds), STARLING_FLWR_LOG=str(log_dir),
               STARLING_SHARED_DATA=str(bench.support.shared_data()), OMP_NUM_THREADS="1",
               # The SuperLink and SuperNodes start flower-superexec and the apps by name.
               PATH=f"{BIN}:{os.environ['PATH']}")
    processes = []
    logs = open(work / "processes.log", "w")
    try:
        processes.append(subprocess.Popen(
            [BIN / "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", "19091"],
            env=env, stdout=logs, stderr=subprocess.STDOUT))
        time.sleep(3)
        for k in range(clients):
            processes.append(subprocess.Popen(
                [BIN / "flower-supernode", "--insecure", "--superlink", "127.0.0.1:19091",
                 "--host", "127.0.0.1", "--port", str(20000 + k),
                 "--node-config", f"partition-id={k} num-partitions={clients}"],
                env=env, stdout=logs, stderr=subprocess.STDOUT))
        # A hundred SuperNodes starting at once keep two cores busy for a minute: `flwr run`
        # then finds the SuperLink too busy to answer. Give them time, and ask again.
        time.sleep(5 + 0.6 * clients)
        for attempt in range(3):
            began = time.monotonic()
            done = subprocess.run([BIN / "flwr", "run", str(app), "bench", "--stream"], env=env,
                                  stdout=logs, stderr=subprocess.STDOUT, timeout=3600)
            if done.returncode == 0:
                break
            print(f"flwr run failed (attempt {attempt + 1}); asking again", file=sys.stderr)
            time.sleep(10)
        done.check_returncode()
        wall = time.monotonic() - began
        names = list(bench.initial_net().state_dict().keys())
        return bench.flower_result(str(log_dir), names, wall)
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        logs.close()
        print(f"flower deployment logs: {work / 'processes.log'}", file=sys.stderr)
