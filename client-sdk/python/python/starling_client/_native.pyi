"""Typed stubs of the extension module (`src/*.rs`): the SDK's participant, operator client and
simulator, with one exception class per way a call fails."""

from collections.abc import Buffer, Callable, Mapping, Sequence
from typing import Any, Literal

__version__: str

class StarlingError(Exception): ...
class InvalidInput(StarlingError): ...
class NotEnrolled(StarlingError): ...
class Unreachable(StarlingError): ...

class Refused(StarlingError):
    status: int | None
    """The HTTP status the coordinator answered with."""
    code: str | None
    """The API's error code (`invalid_field`, `unauthorized`, ...)."""

class TrainerFailed(StarlingError): ...
class RejectedUpdate(StarlingError): ...
class ModelError(StarlingError): ...
class StorageError(StarlingError): ...

class GlobalModel:
    """The run's model, readable only during the trainer or evaluator call it is given to."""

    def names(self) -> list[str]: ...
    def shape(self, name: str) -> list[int]: ...
    def shapes(self) -> dict[str, list[int]]: ...
    def copy_into(self, name: str, target: Buffer) -> None:
        """Copies tensor `name` into a writable C-contiguous float32 buffer of its size."""
    def tensor_bytes(self, name: str) -> bytes:
        """Tensor `name` as little-endian float32 bytes."""
    def __len__(self) -> int: ...

class TrainingSettings:
    epochs: int
    batch_size: int
    learning_rate: float
    optimizer: Literal["sgd", "adam"]
    fedprox_mu: float
    seed: int

class Trained:
    tensors: Mapping[str, Buffer]
    examples: int
    loss: float
    is_delta: bool
    def __init__(self, tensors: Mapping[str, Buffer], examples: int, loss: float, is_delta: bool = False) -> None: ...

class Evaluation:
    loss: float
    accuracy: float
    examples: int
    def __init__(self, loss: float, accuracy: float, examples: int) -> None: ...

Train = Callable[[GlobalModel, TrainingSettings], Trained]
Evaluate = Callable[[GlobalModel], Evaluation | None]

class Outcome:
    kind: Literal["uploaded", "evaluated", "come_back_later", "round_missed", "conditions_not_met"]
    run_id: int | None
    round_idx: int | None
    train_loss: float | None
    evaluation: Evaluation | None
    after_secs: float | None
    unmet: list[str]

class Participant:
    def __init__(
        self,
        url: str,
        population: str,
        *,
        state_file: str | None = None,
        credential: str | None = None,
        ca_pem: str | None = None,
    ) -> None: ...
    def enroll(self, enrollment_token: str) -> int: ...
    def identity_key(self) -> str: ...
    def set_enrolment(self, authority: str, certificate: str | None = None) -> None: ...
    @property
    def enrolled(self) -> bool: ...
    @property
    def device_id(self) -> int | None: ...
    @property
    def has_pending_upload(self) -> bool: ...
    def participate(self, train: Train, evaluate: Evaluate | None = None) -> Outcome: ...

class Operator:
    def __init__(self, url: str, token: str, *, ca_pem: str | None = None) -> None: ...
    def enrollment_token(self, uses: int = 1) -> str: ...
    def create_run(self, plan: Mapping[str, Any]) -> dict[str, Any]: ...
    def run(self, run_id: int) -> dict[str, Any]: ...
    def runs(self) -> list[dict[str, Any]]: ...
    def rounds(self, run_id: int) -> list[dict[str, Any]]: ...
    def models(self, run_id: int) -> list[dict[str, Any]]: ...
    def stop(self, run_id: int) -> dict[str, Any]: ...
    def wait(
        self, run_id: int, *, rounds: int | None = None, timeout_secs: float = 600.0, poll_secs: float = 0.25
    ) -> dict[str, Any]: ...
    def export_model(self, run_id: int, version: int | None = None, *, format: str = "safetensors") -> bytes: ...
    def import_base_model(self, name: str, data: bytes) -> dict[str, Any]: ...
    def report_evaluation(
        self, run_id: int, version: int, evaluator: str, example_count: int, metrics: Mapping[str, float]
    ) -> None: ...

def simulate(
    url: str,
    population: str,
    enrollment_token: str,
    trainers: Sequence[Train],
    *,
    operator: Operator,
    run_id: int,
    evaluators: Sequence[Evaluate] | None = None,
    rounds: int | None = None,
    timeout_secs: float = 600.0,
) -> dict[str, Any]:
    """Runs one device per trainer until the run finishes; `{"run": view, "devices": [...]}`."""

def new_enrolment_authority() -> tuple[str, str]: ...
def certify_identity(authority_secret: str, identity_key: str) -> str: ...
