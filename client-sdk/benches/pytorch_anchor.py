"""PyTorch's CPU training rate for the models `train_throughput` measures: the anchor Starling's
on-device training is held to (docs/benchmarks.md, "Beside PyTorch").

Same data (the first examples of MNIST's test split, pixels / 255), same models (the MNIST 2NN
784-200-200-10 and the FedAvg paper's CNN: two 5×5 convolutions with padding 2, 32 and 64
channels, each with ReLU and 2×2 max pooling, then 512 and 10 units), same training (plain SGD at
lr 0.05 on mean cross-entropy, one epoch over a shuffled order, the loss read back every step as
Starling's loop does), the same subset sizes and two warm-up steps. Prints one line per row in
`train_throughput`'s format, then the machine's sgemm rate through PyTorch (its BLAS), which is
the ceiling the achieved GFLOP/s are compared with.

Run by `vs_pytorch.sh`, which installs PyTorch into a venv of its own; by hand:
`python pytorch_anchor.py ../../shared/data/mnist [threads]`.
"""

import gzip
import math
import struct
import sys
import time

import torch
from torch import nn


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = struct.unpack(">" + "I" * dims, data[4 : 4 + 4 * dims])
    body = torch.frombuffer(bytearray(data[4 + 4 * dims :]), dtype=torch.uint8)
    return body.reshape(shape)


def mlp():
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, 10)
    )


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, 10),
    )


def epoch(model, images, labels, batch, generator):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    order = torch.randperm(len(labels), generator=generator)
    for start in range(0, len(labels), batch):
        idx = order[start : start + batch]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(images[idx]), labels[idx])
        loss.backward()
        optimizer.step()
        if not math.isfinite(loss.item()):
            raise SystemExit("training diverged")


def main():
    mnist = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(threads)
    images = read_idx(f"{mnist}/t10k-images-idx3-ubyte.gz").float().div_(255.0).unsqueeze(1)
    labels = read_idx(f"{mnist}/t10k-labels-idx1-ubyte.gz").long()
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, build, n, batch in [("mlp", mlp, 4000, 10), ("mlp", mlp, 4000, 64), ("cnn", cnn, 300, 10), ("cnn", cnn, 600, 64)]:
        torch.manual_seed(0)
        model = build()
        epoch(model, images[: 2 * batch], labels[: 2 * batch], batch, generator)
        started = time.perf_counter()
        epoch(model, images[:n], labels[:n], batch, generator)
        rate = n / (time.perf_counter() - started)
        print(f"{'torch':<8} {name:<6} {batch:>6} {n:>8} {rate:>12.0f}")
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(timed(lambda: a @ b) for _ in range(5))
    print(f"torch sgemm at 2048³: {2 * 2048**3 / best / 1e9:.1f} GFLOP/s")


def timed(f):
    started = time.perf_counter()
    f()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
