"""The PyTorch adapter: a `torch.nn.Module` as a Starling device's model.

    from starling_client.torch import TorchTrainer, model_section

    plan = {..., "model": model_section(net)}          # the operator's side
    trainer = TorchTrainer(net, fit, evaluate=score)   # the device's side
    device.participate(trainer.train, trainer.evaluate)

`fit(net, settings) -> (examples, loss)` trains `net` in place on the device's own data;
`score(net) -> (loss, accuracy, examples)` evaluates it. The global model goes straight into
the module's tensors (one copy) and the trained tensors are read from their memory (one copy):
no state_dict is built in between.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import Evaluation, GlobalModel, Trained, TrainingSettings, tensors_model

Fit = Callable[[torch.nn.Module, TrainingSettings], "tuple[int, float]"]
Score = Callable[[torch.nn.Module], "tuple[float, float, int] | None"]


def named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's float32 tensors the run's schema names: its `state_dict` entries (parameters
    and float buffers such as batch-norm statistics), in `state_dict` order. They must live on
    the CPU: a GPU module is moved there by the caller, or trained on a CPU copy."""
    tensors = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point():
            continue  # step counters (num_batches_tracked) are not the model's values
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise TypeError(f"{name} is {tensor.dtype} on {tensor.device}: Starling tensors are float32 on the CPU")
        tensors[name] = tensor
    return tensors


def model_section(module: torch.nn.Module, *, init: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plan's `model` section for `module` (kind `tensors`: the names and shapes of its
    `state_dict`'s float tensors)."""
    return tensors_model([(name, tuple(t.shape)) for name, t in named_tensors(module).items()], init=init)


def load_global(module: torch.nn.Module, model: GlobalModel) -> None:
    """Copies the global model into `module`'s tensors, each straight into its memory."""
    tensors = named_tensors(module)
    missing = [n for n in model.names() if n not in tensors]
    if missing:
        raise KeyError(f"the module has no tensors {missing} of the run's model")
    with torch.no_grad():
        for name in model.names():
            tensor = tensors[name]
            if not tensor.is_contiguous():
                raise TypeError(f"{name} is not contiguous")
            model.copy_into(name, tensor.detach().numpy())


def trained(module: torch.nn.Module, names: list[str], examples: int, loss: float) -> Trained:
    """The module's tensors `names` as a `Trained`: views of their memory, read once by the SDK."""
    tensors = named_tensors(module)
    return Trained({n: tensors[n].detach().contiguous().numpy() for n in names}, examples, loss)


class TorchTrainer:
    """A module trained by `fit` (and evaluated by `evaluate`) as a device's trainer."""

    def __init__(self, module: torch.nn.Module, fit: Fit, evaluate: Score | None = None) -> None:
        self.module = module
        self._fit = fit
        self._evaluate = evaluate

    def train(self, model: GlobalModel, settings: TrainingSettings) -> Trained:
        load_global(self.module, model)
        names = model.names()
        self.module.train()
        examples, loss = self._fit(self.module, settings)
        return trained(self.module, names, int(examples), float(loss))

    def evaluate(self, model: GlobalModel) -> Evaluation | None:
        if self._evaluate is None:
            return None
        load_global(self.module, model)
        self.module.eval()
        with torch.no_grad():
            scored = self._evaluate(self.module)
        if scored is None:
            return None
        loss, accuracy, examples = scored
        return Evaluation(float(loss), float(accuracy), int(examples))
