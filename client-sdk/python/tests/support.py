"""What the Python SDK's tests and the Flower comparison share: a coordinator process on a free
port, MNIST from ../shared/data, the CNN both sides train, and its training and scoring loops."""

from __future__ import annotations

import functools
import gzip
import os
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

OPERATOR_TOKEN = f"python-sdk-operator-{os.getpid()}"
REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Coordinator:
    """The coordinator binary (`STARLING_COORDINATOR_BIN`) on a free port over plain HTTP, with
    the embedded store in a temporary directory, or `database_url` (Postgres) when given."""

    def __init__(self, database_url: str | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.dir = tempfile.TemporaryDirectory()
        port = free_port()
        db = database_url or f"sqlite://{self.dir.name}/db.sqlite"
        env = dict(os.environ, STARLING_OPERATOR_TOKEN=OPERATOR_TOKEN, RUST_LOG="warn", **(extra_env or {}))
        binary = os.environ["STARLING_COORDINATOR_BIN"]
        self.args = [binary, "serve", "--listen", f"127.0.0.1:{port}", "--database-url", db, "--insecure-http"]
        self.env = env
        self.url = f"http://127.0.0.1:{port}"
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, env=self.env)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/readyz", timeout=5)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the coordinator at {self.url} did not become ready")
                time.sleep(0.1)

    def kill(self) -> None:
        """Stops the process at once (SIGKILL), keeping its store: `start` brings it back."""
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.dir.cleanup()


def shared_data() -> Path:
    return Path(os.environ.get("STARLING_SHARED_DATA", REPO.parent / "shared" / "data"))


def _idx(path: Path) -> np.ndarray:
    data = gzip.decompress(path.read_bytes())
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


@functools.cache
def mnist(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST's `train` or `t10k` split: images (N, 1, 28, 28) in [0, 1] and labels (read once
    per process; treat them as read-only)."""
    root = shared_data() / "mnist"
    images = _idx(root / f"{split}-images-idx3-ubyte.gz")
    labels = _idx(root / f"{split}-labels-idx1-ubyte.gz")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    return x, torch.from_numpy(labels.astype(np.int64))


def iid_partition(n_examples: int, clients: int, per_client: int, seed: int = 0) -> list[np.ndarray]:
    """`clients` disjoint random shards of `per_client` example indices each."""
    order = np.random.default_rng(seed).permutation(n_examples)
    return [order[i * per_client : (i + 1) * per_client] for i in range(clients)]


class Net(torch.nn.Module):
    """The CNN both sides of the Flower comparison train: Flower's PyTorch quickstart network,
    for one 28×28 channel (two 5×5 convolutions with 2×2 max-pooling, three linear layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 6, 5)
        self.conv2 = torch.nn.Conv2d(6, 16, 5)
        self.fc1 = torch.nn.Linear(16 * 4 * 4, 120)
        self.fc2 = torch.nn.Linear(120, 84)
        self.fc3 = torch.nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def fit(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int, lr: float, seed: int,
        momentum: float = 0.0) -> tuple[int, float]:
    """SGD over (x, y), shuffled by `seed`; (examples per epoch, mean loss)."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    generator = torch.Generator().manual_seed(seed % (2**63))
    total, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
    return len(x), total / max(steps, 1)


def torch_trainer(x: torch.Tensor, y: torch.Tensor, *, momentum: float = 0.0):
    """A fresh `Net` trained by `fit` on (x, y) as the plan's settings say, as a device's
    `TorchTrainer`."""
    from starling_client.torch import TorchTrainer

    def train(net, settings):
        return fit(net, x, y, epochs=settings.epochs, batch_size=settings.batch_size,
                   lr=settings.learning_rate, seed=settings.seed, momentum=momentum)

    return TorchTrainer(Net(), train)


def accuracy(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    """The accuracy on (x, y) of a `Net` holding `state`."""
    net = Net()
    net.load_state_dict(state)
    return score(net, x, y)[1]


@torch.no_grad()
def score(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, int]:
    """(mean loss, accuracy, examples) of `net` on (x, y)."""
    net.eval()
    logits = net(x)
    loss = F.cross_entropy(logits, y).item()
    accuracy = (logits.argmax(1) == y).float().mean().item()
    return loss, accuracy, len(x)


def load_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    """A safetensors file of float32 tensors (as `Operator.export_model` gives), read without
    the safetensors package: an 8-byte header length, a JSON header, the data."""
    import json

    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = memoryview(data)[8 + n :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "F32", entry
        start, end = entry["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(body[start:end], dtype="<f4").copy()).reshape(entry["shape"])
    return out


def save_safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """`tensors` as a safetensors file of float32 (what `Operator.import_base_model` takes)."""
    import json

    header, chunks, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks)
