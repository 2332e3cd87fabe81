"""Starling federated learning for Python.

A device trains the run's model with its own code (PyTorch, JAX, NumPy, ...) and the SDK does
the rest of the participation: check-in, eligibility, resumable uploads, compression, DP
clipping, SecAgg+ masking. The operator's side creates runs from plan dicts, watches them and
exports their models; `simulate` plays a fleet of Python devices against a coordinator.

    import starling_client as sc

    device = sc.Participant("http://127.0.0.1:8080", "keyboard", state_file="device.json")
    device.enroll(token)
    outcome = device.participate(train)   # train(model: GlobalModel, settings) -> Trained

`starling_client.torch` adapts a `torch.nn.Module` (its `state_dict` ↔ the run's named tensors).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._native import (
    Evaluation,
    GlobalModel,
    InvalidInput,
    ModelError,
    NotEnrolled,
    Operator,
    Outcome,
    Participant,
    Refused,
    RejectedUpdate,
    StarlingError,
    StorageError,
    Trained,
    TrainerFailed,
    TrainingSettings,
    Unreachable,
    __version__,
    certify_identity,
    new_enrolment_authority,
    simulate,
)

__all__ = [
    "Evaluation",
    "GlobalModel",
    "InvalidInput",
    "ModelError",
    "NotEnrolled",
    "Operator",
    "Outcome",
    "Participant",
    "Refused",
    "RejectedUpdate",
    "StarlingError",
    "StorageError",
    "Trained",
    "TrainerFailed",
    "TrainingSettings",
    "Unreachable",
    "__version__",
    "arrays",
    "certify_identity",
    "new_enrolment_authority",
    "tensors_model",
    "simulate",
]


def arrays(model: GlobalModel) -> dict[str, np.ndarray]:
    """The global model as read-only NumPy arrays by name (one copy of each tensor); call it
    inside the trainer, which is the only place the model can be read."""
    return {
        name: np.frombuffer(model.tensor_bytes(name), dtype="<f4").reshape(model.shape(name))
        for name in model.names()
    }


def tensors_model(shapes: dict[str, tuple[int, ...]] | list[tuple[str, tuple[int, ...]]], *, init: dict[str, Any] | None = None) -> dict[str, Any]:
    """A plan's `model` section for a model only the devices can run (kind `tensors`): its
    tensors' names and shapes, in order (float32), and how version 0 is made (`init`, default:
    Glorot-uniform weights and zero biases from seed 0; `{"kind": "base_model", "hash": ...}`
    starts from a model imported with `Operator.import_base_model`)."""
    items = shapes.items() if isinstance(shapes, dict) else shapes
    schema = [{"name": name, "shape": [int(d) for d in shape], "dtype": "f32"} for name, shape in items]
    return {"kind": "tensors", "schema": {"tensors": schema}, "init": init or {"kind": "seeded", "seed": 0}}
