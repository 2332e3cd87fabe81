"""The FFI layer through UniFFI's Python bindings, against a live coordinator.

`cargo xtask test` generates the bindings (`uniffi-bindgen generate --language python`), puts
them and the library on PYTHONPATH, and runs this with the coordinator binary and the digits
directory in STARLING_COORDINATOR_BIN and STARLING_DIGITS_DIR.
"""

import json
import math
import os
import socket
import ssl
import struct
import subprocess
import tempfile
import time
import unittest
import urllib.request

import starling_mobile as sm

TOKEN = f"mobile-test-operator-{os.getpid()}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_idx(path):
    with open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return dims, data[4 + 4 * ndim :]


def digits():
    root = os.environ["STARLING_DIGITS_DIR"]
    dims, pixels = read_idx(os.path.join(root, "digits-images-idx3-ubyte"))
    _, labels = read_idx(os.path.join(root, "digits-labels-idx1-ubyte"))
    width = dims[1] * dims[2]
    features = [p / 16.0 for p in pixels]
    return [features[i * width : (i + 1) * width] for i in range(dims[0])], list(labels)


class Coordinator:
    """The coordinator binary on a free port: plain HTTP, or TLS with a fresh self-signed
    certificate (`self.cert`) made by openssl."""

    def __init__(self, tls=False):
        self.dir = tempfile.TemporaryDirectory()
        port = free_port()
        db = f"sqlite://{self.dir.name}/db.sqlite"
        env = dict(os.environ, STARLING_OPERATOR_TOKEN=TOKEN, RUST_LOG="warn")
        args = [os.environ["STARLING_COORDINATOR_BIN"], "serve", "--listen", f"127.0.0.1:{port}", "--database-url", db]
        self.context = None
        if tls:
            self.cert, key = os.path.join(self.dir.name, "cert.pem"), os.path.join(self.dir.name, "key.pem")
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                 "-addext", "basicConstraints=critical,CA:FALSE", "-addext", "extendedKeyUsage=serverAuth",
                 "-keyout", key, "-out", self.cert],
                check=True, capture_output=True,
            )
            args += ["--tls-cert", self.cert, "--tls-key", key]
            self.context = ssl.create_default_context(cafile=self.cert)
            self.url = f"https://127.0.0.1:{port}"
        else:
            args.append("--insecure-http")
            self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(args, env=env)
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(self.url + "/healthz", context=self.context)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)

    def admin(self, method, path, body=None):
        req = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, context=self.context) as res:
            return json.loads(res.read() or "null")

    def close(self):
        self.proc.terminate()
        self.proc.wait()
        self.dir.cleanup()


class Phases(sm.ProgressListener):
    def __init__(self):
        self.phases, self.steps = [], 0

    def on_phase(self, phase):
        self.phases.append(phase)

    def on_step(self, epoch, batch, batches, loss):
        self.steps += 1


SHAPE = sm.ExampleShape.IMAGE(channels=1, height=8, width=8)


class WithCoordinator(unittest.TestCase):
    """One coordinator and the digits for a class's tests."""

    @classmethod
    def setUpClass(cls):
        cls.c = Coordinator()
        cls.features, cls.labels = digits()

    @classmethod
    def tearDownClass(cls):
        cls.c.close()


class MobileBindings(WithCoordinator):
    def test_a_device_participates_and_the_global_model_improves(self):
        spec = {
            "input": {"kind": "image", "channels": 1, "height": 8, "width": 8},
            "layers": [{"kind": "flatten"}, {"kind": "linear", "out": 32}, {"kind": "relu"}, {"kind": "linear", "out": 10}],
        }
        run = self.c.admin("POST", "/v1/admin/runs", {
            "population": "phones",
            "model": {"spec": spec, "init": {"kind": "seeded", "seed": 3}},
            "training": {"epochs": 3, "batch_size": 10, "lr": 0.1},
            "cohort_size": 1, "min_quorum": 1, "over_selection": 1.0,
            "selection_timeout_secs": 30, "reporting_timeout_secs": 60, "rounds": 4,
            "eligibility": {"charging": True, "min_app_version": "2.0"},
        })
        # The token names the population its devices may join.
        token = self.c.admin(
            "POST", "/v1/admin/enrollment-tokens", {"uses": 1, "populations": ["phones"]}
        )["token"]
        storage = tempfile.mkdtemp()
        device = sm.StarlingDevice(self.c.url, "phones", None, storage, SHAPE)
        device.add_examples(self.features[0], [self.labels[0]])
        with self.assertRaises(sm.StarlingError.NotEnrolled):
            device.participate()
        device.clear_examples()
        device_id = device.enroll(token)
        self.assertTrue(device.status().enrolled)
        flat = [v for row in self.features[:600] for v in row]
        device.add_examples(flat, self.labels[:600])
        listener = Phases()
        device.set_progress_listener(listener)
        # The plan wants charging devices of app 2.0 or later: until it says so, it waits.
        self.assertIsInstance(device.participate(), sm.ParticipationOutcome.COME_BACK_LATER)
        device.set_conditions(sm.DeviceConditions(charging=True, app_version="2.3.1"))

        accuracies = []
        while len(accuracies) < 4:
            outcome = device.participate()
            if isinstance(outcome, sm.ParticipationOutcome.UPLOADED):
                self.assertIsNotNone(outcome.evaluation)
                accuracies.append(outcome.evaluation.accuracy)
            else:
                time.sleep(0.2)
        self.assertEqual(device.status().uploads, 4)
        self.assertIn("training", listener.phases)
        self.assertGreater(listener.steps, 0)
        # Each round's global model is evaluated on held-out examples before training: after
        # three committed rounds it is far better than the initial one.
        self.assertGreater(accuracies[-1], accuracies[0] + 0.3, accuracies)
        self.assertEqual(device.last_metrics().accuracy, accuracies[-1])
        status = self.c.admin("GET", f"/v1/admin/runs/{run['id']}")
        self.assertGreaterEqual(status["rounds_committed"], 3)

        # The credential survives a restart through the storage directory.
        again = sm.StarlingDevice(self.c.url, "phones", None, storage, SHAPE)
        self.assertEqual(again.status().device_id, device_id)
        self.assertEqual(json.loads(again.export_state())["credential"], json.loads(device.export_state())["credential"])

    def test_a_device_unplugged_after_its_check_in_does_not_train(self):
        self.c.admin("POST", "/v1/admin/runs", {
            "population": "tablets",
            "model": {"spec": {
                "input": {"kind": "image", "channels": 1, "height": 8, "width": 8},
                "layers": [{"kind": "flatten"}, {"kind": "linear", "out": 10}],
            }, "init": {"kind": "seeded", "seed": 3}},
            "training": {"epochs": 1, "batch_size": 10, "lr": 0.1},
            "cohort_size": 1, "min_quorum": 1, "over_selection": 1.0,
            "selection_timeout_secs": 30, "reporting_timeout_secs": 60, "rounds": 1,
            "eligibility": {"charging": True, "min_battery_percent": 30},
        })
        token = self.c.admin(
            "POST", "/v1/admin/enrollment-tokens", {"uses": 1, "populations": ["tablets"]}
        )["token"]
        device = sm.StarlingDevice(self.c.url, "tablets", None, tempfile.mkdtemp(), SHAPE)
        device.enroll(token)
        device.add_examples([v for row in self.features[:200] for v in row], self.labels[:200])
        device.set_conditions(sm.DeviceConditions(charging=True, battery_percent=80))

        class Unplug(Phases):
            def on_phase(self, phase):
                super().on_phase(phase)
                if phase == "downloading":
                    device.set_conditions(sm.DeviceConditions(charging=False, battery_percent=80))

        listener = Unplug()
        device.set_progress_listener(listener)
        deadline = time.time() + 120
        while True:
            self.assertLess(time.time(), deadline, "never selected")
            outcome = device.participate()
            if isinstance(outcome, sm.ParticipationOutcome.CONDITIONS_NOT_MET):
                self.assertEqual(outcome.unmet, ["charging"])
                break
            self.assertIsInstance(outcome, sm.ParticipationOutcome.COME_BACK_LATER)
            time.sleep(0.2)
        self.assertNotIn("training", listener.phases)
        self.assertEqual((listener.steps, device.status().uploads), (0, 0))

    def test_bad_input_raises_typed_errors(self):
        storage = tempfile.mkdtemp()
        device = sm.StarlingDevice(self.c.url, "nobody", "not-a-real-credential", storage, SHAPE)
        with self.assertRaises(sm.StarlingError.NoExamples):
            device.participate()
        with self.assertRaises(sm.StarlingError.InvalidInput):
            device.add_examples([0.0] * 63, [1])  # one value short
        with self.assertRaises(sm.StarlingError.InvalidInput):
            device.add_examples([float("nan")] * 64, [1])
        self.assertEqual(device.status().examples, 0)
        with self.assertRaises(sm.StarlingError.InvalidInput):
            device.set_conditions(sm.DeviceConditions(battery_percent=101))
        device.add_examples(self.features[0], [self.labels[0]])
        with self.assertRaises(sm.StarlingError.Refused):
            device.participate()  # the coordinator does not know this credential
        with self.assertRaises(sm.StarlingError.InvalidInput):
            sm.StarlingDevice("ftp://example", "p", None, storage, SHAPE)
        with self.assertRaises(sm.StarlingError.InvalidInput):
            sm.StarlingDevice(self.c.url, "p", None, storage, sm.ExampleShape.FEATURES(size=0))
        with self.assertRaises(sm.StarlingError.InvalidInput):
            device.restore_state("{not json")
        # The identity key the operator certifies is made once and kept; an unreadable
        # authority, or a certificate that is not the authority's for this key, changes nothing.
        key = device.identity_key()
        self.assertEqual((len(key), device.identity_key()), (64, key))
        authority = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
        with self.assertRaises(sm.StarlingError.InvalidInput):
            device.set_enrolment("not hex", None)
        with self.assertRaises(sm.StarlingError.InvalidInput):
            device.set_enrolment(authority, "ab" * 64)
        self.assertNotIn("enrolment", device.export_state())
        device.set_enrolment(authority, None)  # pins the authority, holds no certificate yet
        pinned = json.loads(device.export_state())["enrolment"]["authority"]
        self.assertEqual(bytes(pinned).hex(), authority)
        # Nobody listens on this port.
        gone = sm.StarlingDevice(f"http://127.0.0.1:{free_port()}", "p", "cred", tempfile.mkdtemp(), SHAPE)
        gone.add_examples(self.features[0], [self.labels[0]])
        with self.assertRaises(sm.StarlingError.Unreachable):
            gone.participate()


SOFTMAX = {"tensors": [
    {"name": "weight", "shape": [10, 64], "dtype": "f32"},
    {"name": "bias", "shape": [10], "dtype": "f32"},
]}


def softmax_scores(weight, bias, x):
    z = [bias[c] + sum(w * v for w, v in zip(weight[c * 64:(c + 1) * 64], x)) for c in range(10)]
    top = max(z)
    e = [math.exp(v - top) for v in z]
    total = sum(e)
    return [v / total for v in e]


class SoftmaxTrainer(sm.AppTrainer):
    """An app's own trainer, in Python: SGD on softmax regression over its own digits."""

    def __init__(self, train, holdout):
        self.train_set, self.holdout = train, holdout
        self.rounds = 0

    def train(self, model, settings):
        tensors = {t.name: list(t.values) for t in model}
        weight, bias = tensors["weight"], tensors["bias"]
        lr, loss = settings.learning_rate, 0.0
        for _ in range(settings.epochs):
            loss = 0.0
            for x, y in zip(*self.train_set):
                p = softmax_scores(weight, bias, x)
                loss -= math.log(max(p[y], 1e-12))
                for c in range(10):
                    g = p[c] - (1.0 if c == y else 0.0)
                    if g:
                        row = c * 64
                        for j, v in enumerate(x):
                            if v:
                                weight[row + j] -= lr * g * v
                        bias[c] -= lr * g
        self.rounds += 1
        n = len(self.train_set[1])
        return sm.TrainedTensors(
            tensors=[sm.NamedTensor(name=t.name, shape=t.shape, values=tensors[t.name]) for t in model],
            is_delta=False, examples=n, loss=loss / n,
        )

    def evaluate(self, model):
        tensors = {t.name: t.values for t in model}
        xs, ys = self.holdout
        correct, loss = 0, 0.0
        for x, y in zip(xs, ys):
            p = softmax_scores(tensors["weight"], tensors["bias"], x)
            correct += max(range(10), key=lambda c: p[c]) == y
            loss -= math.log(max(p[y], 1e-12))
        return sm.ModelMetrics(accuracy=correct / len(ys), loss=loss / len(ys), examples=len(ys))


class Raising(sm.AppTrainer):
    def train(self, model, settings):
        raise sm.TrainerError.Failed("the app's model file is missing")

    def evaluate(self, model):
        return None


class AppTrainerTest(WithCoordinator):
    def schema_run(self, population, rounds):
        return self.c.admin("POST", "/v1/admin/runs", {
            "population": population,
            "model": {"schema": SOFTMAX, "init": {"kind": "zeros"}},
            "training": {"epochs": 1, "batch_size": 1, "lr": 0.1},
            "cohort_size": 1, "min_quorum": 1, "over_selection": 1.0,
            "selection_timeout_secs": 30, "reporting_timeout_secs": 60, "rounds": rounds,
        })

    def device(self, population, trainer):
        token = self.c.admin(
            "POST", "/v1/admin/enrollment-tokens", {"uses": 1, "populations": [population]}
        )["token"]
        device = sm.StarlingDevice(self.c.url, population, None, tempfile.mkdtemp(), SHAPE)
        device.enroll(token)
        device.set_trainer(trainer)
        return device

    def test_a_python_trainer_trains_a_run_of_named_tensors_and_the_model_improves(self):
        self.schema_run("py-trainers", 3)
        trainer = SoftmaxTrainer(
            (self.features[:300], self.labels[:300]), (self.features[1500:1700], self.labels[1500:1700])
        )
        device = self.device("py-trainers", trainer)
        accuracies, deadline = [], time.time() + 120
        while len(accuracies) < 3:
            self.assertLess(time.time(), deadline, accuracies)
            outcome = device.participate()
            if isinstance(outcome, sm.ParticipationOutcome.UPLOADED):
                accuracies.append(outcome.evaluation.accuracy)
            else:
                time.sleep(0.2)
        self.assertEqual(trainer.rounds, 3)
        # The zero model scores one class in ten; two rounds of the trainer's SGD far more.
        self.assertGreater(accuracies[-1], accuracies[0] + 0.5, accuracies)

    def test_a_trainer_that_raises_fails_the_participation_and_sends_nothing(self):
        run = self.schema_run("py-raising", 1)
        device = self.device("py-raising", Raising())
        deadline = time.time() + 60
        while True:
            self.assertLess(time.time(), deadline, "never selected")
            try:
                outcome = device.participate()
            except sm.StarlingError.Training as e:
                self.assertIn("the app's model file is missing", str(e))
                break
            self.assertIsInstance(outcome, sm.ParticipationOutcome.COME_BACK_LATER)
            time.sleep(0.2)
        rounds = self.c.admin("GET", f"/v1/admin/runs/{run['id']}/rounds")
        self.assertEqual(rounds[0]["n_reported"], 0)
        self.assertEqual(device.status().uploads, 0)


class TlsTest(unittest.TestCase):
    def test_a_device_verifies_the_coordinator_against_its_ca(self):
        c = Coordinator(tls=True)
        try:
            token = c.admin(
                "POST", "/v1/admin/enrollment-tokens", {"uses": 2, "populations": ["p"]}
            )["token"]
            with open(c.cert) as f:
                ca = f.read()
            # The platform's trust store does not know this certificate: no connection.
            untrusting = sm.StarlingDevice(c.url, "p", None, tempfile.mkdtemp(), SHAPE)
            with self.assertRaises(sm.StarlingError.Unreachable):
                untrusting.enroll(token)
            with self.assertRaises(sm.StarlingError.InvalidInput):
                untrusting.set_tls("not a certificate", None)
            device = sm.StarlingDevice(c.url, "p", None, tempfile.mkdtemp(), SHAPE)
            device.set_tls(ca, None)
            self.assertGreater(device.enroll(token), 0)
            self.assertEqual(len(c.admin("GET", "/v1/admin/devices")), 1)
        finally:
            c.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
