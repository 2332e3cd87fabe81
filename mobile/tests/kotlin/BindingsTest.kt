// The FFI layer through UniFFI's generated Kotlin, the code an Android app compiles, run on the
// desktop JVM through JNA against a live coordinator. `cargo xtask test` compiles this with the
// generated bindings (kotlinc from the npm registry's kotlin-compiler, Debian's JNA) and runs it
// with the coordinator binary in STARLING_COORDINATOR_BIN, the digits in STARLING_DIGITS_DIR and
// the library on jna.library.path. Each test says what it checks; the process exits non-zero
// when one fails.
package dev.starling.bindingstest

import java.io.File
import java.net.ServerSocket
import java.net.URI
import java.net.http.HttpClient
import java.net.http.HttpRequest
import java.net.http.HttpResponse
import java.nio.file.Files
import kotlin.system.exitProcess
import uniffi.starling_mobile.AppTrainer
import uniffi.starling_mobile.DeviceConditions
import uniffi.starling_mobile.ExampleShape
import uniffi.starling_mobile.ModelMetrics
import uniffi.starling_mobile.NamedTensor
import uniffi.starling_mobile.ParticipationOutcome
import uniffi.starling_mobile.ProgressListener
import uniffi.starling_mobile.StarlingDevice
import uniffi.starling_mobile.StarlingException
import uniffi.starling_mobile.TrainedTensors
import uniffi.starling_mobile.TrainerException
import uniffi.starling_mobile.TrainingSettings

val TOKEN = "kotlin-test-operator-${ProcessHandle.current().pid()}"
val SHAPE = ExampleShape.Image(channels = 1uL, height = 8uL, width = 8uL)
const val DEADLINE_MS = 120_000L

/** The coordinator binary on a free port, on a fresh embedded store. */
class Coordinator : AutoCloseable {
    private val dir = Files.createTempDirectory("starling-kotlin").toFile()
    private val port = ServerSocket(0).use { it.localPort }
    val url = "http://127.0.0.1:$port"
    private val http = HttpClient.newHttpClient()
    private val process: Process

    init {
        val builder = ProcessBuilder(
            System.getenv("STARLING_COORDINATOR_BIN"), "serve", "--insecure-http",
            "--listen", "127.0.0.1:$port", "--database-url", "sqlite://${dir.path}/db.sqlite",
        ).inheritIO()
        builder.environment()["STARLING_OPERATOR_TOKEN"] = TOKEN
        builder.environment()["RUST_LOG"] = "warn"
        process = builder.start()
        val deadline = System.currentTimeMillis() + 30_000
        while (true) {
            val up = runCatching {
                http.send(HttpRequest.newBuilder(URI("$url/healthz")).build(), HttpResponse.BodyHandlers.ofString())
            }.isSuccess
            if (up) break
            check(process.isAlive) { "the coordinator exited" }
            check(System.currentTimeMillis() < deadline) { "the coordinator did not answer within 30 s" }
            Thread.sleep(100)
        }
    }

    /** An admin API call; the answer's body. */
    fun admin(method: String, path: String, body: String? = null): String {
        val request = HttpRequest.newBuilder(URI(url + path))
            .header("Authorization", "Bearer $TOKEN")
            .header("Content-Type", "application/json")
            .method(method, body?.let { HttpRequest.BodyPublishers.ofString(it) } ?: HttpRequest.BodyPublishers.noBody())
            .build()
        val response = http.send(request, HttpResponse.BodyHandlers.ofString())
        check(response.statusCode() in 200..299) { "$method $path: ${response.statusCode()} ${response.body()}" }
        return response.body()
    }

    /** A one-use enrollment token for `population`. */
    fun enrollmentToken(population: String): String =
        field(admin("POST", "/v1/admin/enrollment-tokens", """{"uses": 1, "populations": ["$population"]}"""), "token")

    override fun close() {
        process.destroy()
        process.waitFor()
        dir.deleteRecursively()
    }
}

/** A top-level string or number field of a JSON object (the JVM has no JSON parser). */
fun field(json: String, name: String): String =
    Regex("\"$name\"\\s*:\\s*(\"([^\"]*)\"|-?[0-9.]+)").find(json)?.let { it.groupValues[2].ifEmpty { it.groupValues[1] } }
        ?: error("no $name in $json")

/** The digits (8x8, 16 grey levels) as features in [0, 1] and labels. */
fun digits(): Pair<List<List<Float>>, List<UInt>> {
    val root = File(System.getenv("STARLING_DIGITS_DIR"))
    fun idx(name: String): Pair<List<Int>, ByteArray> {
        val bytes = File(root, name).readBytes()
        val ndim = bytes[3].toInt()
        val dims = (0 until ndim).map { d ->
            (0 until 4).fold(0) { acc, i -> (acc shl 8) or (bytes[4 + 4 * d + i].toInt() and 0xff) }
        }
        return dims to bytes.copyOfRange(4 + 4 * ndim, bytes.size)
    }
    val (dims, pixels) = idx("digits-images-idx3-ubyte")
    val (_, labels) = idx("digits-labels-idx1-ubyte")
    val width = dims[1] * dims[2]
    val features = (0 until dims[0]).map { i -> (0 until width).map { j -> (pixels[i * width + j].toInt() and 0xff) / 16f } }
    return features to labels.map { (it.toInt() and 0xff).toUInt() }
}

fun mlpRun(population: String, rounds: Int, eligibility: String): String = """
    {"population": "$population",
     "model": {"spec": {"input": {"kind": "image", "channels": 1, "height": 8, "width": 8},
               "layers": [{"kind": "flatten"}, {"kind": "linear", "out": 32}, {"kind": "relu"}, {"kind": "linear", "out": 10}]},
               "init": {"kind": "seeded", "seed": 3}},
     "training": {"epochs": 3, "batch_size": 10, "lr": 0.1},
     "cohort_size": 1, "min_quorum": 1, "over_selection": 1.0,
     "selection_timeout_secs": 30, "reporting_timeout_secs": 60, "rounds": $rounds,
     "eligibility": $eligibility}
"""

/** Records the phases and steps the SDK reports through the listener. */
open class Phases : ProgressListener {
    val phases = java.util.Collections.synchronizedList(mutableListOf<String>())
    @Volatile var steps = 0

    override fun onPhase(phase: String) {
        phases.add(phase)
    }

    override fun onStep(epoch: UInt, batch: UInt, batches: UInt, loss: Double) {
        check(loss.isFinite() && batch < batches) { "step $batch of $batches, loss $loss" }
        steps += 1
    }
}

inline fun <reified E : Throwable> assertThrows(what: String, block: () -> Unit) {
    try {
        block()
    } catch (e: Throwable) {
        check(e is E) { "$what: expected ${E::class.simpleName}, got $e" }
        return
    }
    error("$what: expected ${E::class.simpleName}, nothing was thrown")
}

fun flat(features: List<List<Float>>): List<Float> = features.flatten()

/** Participates until `uploads` updates were uploaded (within [DEADLINE_MS]), waiting a little
 * after any other outcome; the accuracy each upload's evaluation reported, in order. */
fun participateUntilUploaded(device: StarlingDevice, uploads: Int): List<Double> {
    val accuracies = mutableListOf<Double>()
    val deadline = System.currentTimeMillis() + DEADLINE_MS
    while (accuracies.size < uploads) {
        check(System.currentTimeMillis() < deadline) { "$uploads uploads not done within $DEADLINE_MS ms: $accuracies" }
        when (val outcome = device.participate()) {
            is ParticipationOutcome.Uploaded -> accuracies.add(checkNotNull(outcome.evaluation).accuracy)
            else -> Thread.sleep(200)
        }
    }
    return accuracies
}

/** Enrolls, adds examples, participates until the global model improves; the listener is
 * called; the credential survives a restart and an export/restore. */
fun aDeviceParticipatesAndTheGlobalModelImproves(c: Coordinator) {
    val (features, labels) = digits()
    val run = c.admin("POST", "/v1/admin/runs", mlpRun("phones", 4, """{"charging": true, "min_app_version": "2.0"}"""))
    val token = c.enrollmentToken("phones")
    val storage = Files.createTempDirectory("starling-device").toString()
    val device = StarlingDevice(c.url, "phones", null, storage, SHAPE)
    device.addExamples(features[0], listOf(labels[0]))
    assertThrows<StarlingException.NotEnrolled>("participating before enrolling") { device.participate() }
    device.clearExamples()
    val deviceId = device.enroll(token)
    check(device.status().enrolled && device.status().deviceId == deviceId)
    device.addExamples(flat(features.take(600)), labels.take(600))
    check(device.status().examples == 600uL)
    val listener = Phases()
    device.setProgressListener(listener)
    // The plan wants charging devices of app 2.0 or later: until it says so, it waits.
    check(device.participate() is ParticipationOutcome.ComeBackLater)
    device.setConditions(DeviceConditions(charging = true, appVersion = "2.3.1"))

    val accuracies = participateUntilUploaded(device, 4)
    check(device.status().uploads == 4uL) { "${device.status()}" }
    check("training" in listener.phases && listener.steps > 0) { "${listener.phases}, ${listener.steps} steps" }
    // Each round's global model is evaluated on held-out examples before training: after three
    // committed rounds it is far better than the initial one.
    check(accuracies.last() > accuracies.first() + 0.3) { "$accuracies" }
    check(device.lastMetrics()?.accuracy == accuracies.last())
    val status = c.admin("GET", "/v1/admin/runs/${field(run, "id")}")
    check(field(status, "rounds_committed").toInt() >= 3) { status }

    // The credential survives a restart through the storage directory, and an export/restore.
    val again = StarlingDevice(c.url, "phones", null, storage, SHAPE)
    check(again.status().deviceId == deviceId)
    val elsewhere = StarlingDevice(c.url, "phones", null, Files.createTempDirectory("starling-device").toString(), SHAPE)
    check(!elsewhere.status().enrolled)
    elsewhere.restoreState(device.exportState())
    check(elsewhere.status().enrolled && elsewhere.status().deviceId == deviceId)
    listOf(device, again, elsewhere).forEach { it.close() }
}

/** A device unplugged after its check-in leaves the round before training: the SDK checks the
 * conditions of the moment, not only reports them. */
fun aDeviceUnpluggedAfterItsCheckInDoesNotTrain(c: Coordinator) {
    val (features, labels) = digits()
    c.admin("POST", "/v1/admin/runs", mlpRun("tablets", 1, """{"charging": true, "min_battery_percent": 30}"""))
    val device = StarlingDevice(c.url, "tablets", null, Files.createTempDirectory("starling-device").toString(), SHAPE)
    device.enroll(c.enrollmentToken("tablets"))
    device.addExamples(flat(features.take(200)), labels.take(200))
    device.setConditions(DeviceConditions(charging = true, batteryPercent = 80u))
    val listener = object : Phases() {
        override fun onPhase(phase: String) {
            super.onPhase(phase)
            if (phase == "downloading") device.setConditions(DeviceConditions(charging = false, batteryPercent = 80u))
        }
    }
    device.setProgressListener(listener)
    val deadline = System.currentTimeMillis() + DEADLINE_MS
    while (true) {
        check(System.currentTimeMillis() < deadline) { "never selected within $DEADLINE_MS ms" }
        when (val outcome = device.participate()) {
            is ParticipationOutcome.ConditionsNotMet -> {
                check(outcome.unmet == listOf("charging")) { "${outcome.unmet}" }
                break
            }
            is ParticipationOutcome.ComeBackLater -> Thread.sleep(200)
            else -> error("trained although unplugged: $outcome")
        }
    }
    check("training" !in listener.phases && listener.steps == 0) { "${listener.phases}" }
    check(device.status().uploads == 0uL)
    device.close()
}

/** Bad input gets a typed exception and changes nothing. */
fun badInputRaisesTypedExceptions(c: Coordinator) {
    val (features, labels) = digits()
    val storage = Files.createTempDirectory("starling-device").toString()
    val device = StarlingDevice(c.url, "nobody", "not-a-real-credential", storage, SHAPE)
    assertThrows<StarlingException.NoExamples>("an empty store") { device.participate() }
    assertThrows<StarlingException.InvalidInput>("one value short") { device.addExamples(List(63) { 0f }, listOf(1u)) }
    assertThrows<StarlingException.InvalidInput>("NaN") { device.addExamples(List(64) { Float.NaN }, listOf(1u)) }
    check(device.status().examples == 0uL)
    assertThrows<StarlingException.InvalidInput>("a battery at 101 %") {
        device.setConditions(DeviceConditions(batteryPercent = 101u))
    }
    device.addExamples(features[0], listOf(labels[0]))
    // The coordinator does not know this credential.
    assertThrows<StarlingException.Refused>("an unknown credential") { device.participate() }
    assertThrows<StarlingException.InvalidInput>("an ftp URL") { StarlingDevice("ftp://example", "p", null, storage, SHAPE) }
    assertThrows<StarlingException.InvalidInput>("an empty shape") {
        StarlingDevice(c.url, "p", null, storage, ExampleShape.Features(size = 0uL))
    }
    assertThrows<StarlingException.InvalidInput>("a state that is not JSON") { device.restoreState("{not json") }
    val port = ServerSocket(0).use { it.localPort }
    val gone = StarlingDevice("http://127.0.0.1:$port", "p", "cred", Files.createTempDirectory("starling-device").toString(), SHAPE)
    gone.addExamples(features[0], listOf(labels[0]))
    try {
        gone.participate()
        error("participating with nobody listening succeeded")
    } catch (e: StarlingException.Unreachable) {
        check(e.reason.isNotEmpty()) { "an Unreachable without a reason" }
    }
    listOf(device, gone).forEach { it.close() }
}

/** Softmax regression's class probabilities for one example (weight 10x64, then bias). */
fun softmax(weight: FloatArray, bias: FloatArray, x: List<Float>): DoubleArray {
    val z = DoubleArray(10) { c -> bias[c] + (0 until 64).sumOf { j -> (weight[c * 64 + j] * x[j]).toDouble() } }
    val top = z.max()
    val e = z.map { Math.exp(it - top) }
    val total = e.sum()
    return DoubleArray(10) { e[it] / total }
}

/** An app's own trainer, written in Kotlin: SGD on softmax regression over its own digits, the
 * way an Android app would hand the SDK its TFLite or ExecuTorch training. */
class KotlinSoftmaxTrainer(
    private val train: Pair<List<List<Float>>, List<UInt>>,
    private val holdout: Pair<List<List<Float>>, List<UInt>>,
) : AppTrainer {
    @Volatile var rounds = 0

    override fun train(model: List<NamedTensor>, settings: TrainingSettings): TrainedTensors {
        val weight = model.first { it.name == "weight" }.values.toFloatArray()
        val bias = model.first { it.name == "bias" }.values.toFloatArray()
        var loss = 0.0
        repeat(settings.epochs.toInt()) {
            loss = 0.0
            for ((x, y) in train.first.zip(train.second)) {
                val p = softmax(weight, bias, x)
                loss -= Math.log(maxOf(p[y.toInt()], 1e-12))
                for (c in 0 until 10) {
                    val g = (p[c] - if (c == y.toInt()) 1.0 else 0.0) * settings.learningRate
                    for (j in 0 until 64) weight[c * 64 + j] -= (g * x[j]).toFloat()
                    bias[c] -= g.toFloat()
                }
            }
        }
        rounds += 1
        val n = train.second.size
        return TrainedTensors(
            tensors = listOf(
                NamedTensor("weight", listOf(10uL, 64uL), weight.toList()),
                NamedTensor("bias", listOf(10uL), bias.toList()),
            ),
            isDelta = false,
            examples = n.toULong(),
            loss = loss / n,
        )
    }

    override fun evaluate(model: List<NamedTensor>): ModelMetrics? {
        val weight = model.first { it.name == "weight" }.values.toFloatArray()
        val bias = model.first { it.name == "bias" }.values.toFloatArray()
        var correct = 0
        var loss = 0.0
        for ((x, y) in holdout.first.zip(holdout.second)) {
            val p = softmax(weight, bias, x)
            if (p.indices.maxBy { p[it] } == y.toInt()) correct += 1
            loss -= Math.log(maxOf(p[y.toInt()], 1e-12))
        }
        val n = holdout.second.size
        return ModelMetrics(accuracy = correct.toDouble() / n, loss = loss / n, examples = n.toULong())
    }
}

fun schemaRun(population: String, rounds: Int): String = """
    {"population": "$population",
     "model": {"schema": {"tensors": [{"name": "weight", "shape": [10, 64], "dtype": "f32"},
                                      {"name": "bias", "shape": [10], "dtype": "f32"}]},
               "init": {"kind": "zeros"}},
     "training": {"epochs": 1, "batch_size": 1, "lr": 0.1},
     "cohort_size": 1, "min_quorum": 1, "over_selection": 1.0,
     "selection_timeout_secs": 30, "reporting_timeout_secs": 60, "rounds": $rounds}
"""

/** A device whose model the app trains with its own trainer, in Kotlin: the SDK does the
 * check-in, download and upload; the run's model improves. A trainer that throws fails the
 * participation and nothing is sent. */
fun aKotlinTrainerTrainsARunOfNamedTensors(c: Coordinator) {
    val (features, labels) = digits()
    c.admin("POST", "/v1/admin/runs", schemaRun("kotlin-trainers", 3))
    val trainer = KotlinSoftmaxTrainer(
        features.take(300) to labels.take(300),
        features.subList(1500, 1700) to labels.subList(1500, 1700),
    )
    val device = StarlingDevice(c.url, "kotlin-trainers", null, Files.createTempDirectory("starling-device").toString(), SHAPE)
    device.enroll(c.enrollmentToken("kotlin-trainers"))
    device.setTrainer(trainer)
    val accuracies = participateUntilUploaded(device, 3)
    check(trainer.rounds == 3) { "the Kotlin trainer trained ${trainer.rounds} times" }
    // The zero model scores one class in ten; two rounds of the Kotlin trainer's SGD far more.
    check(accuracies.last() > accuracies.first() + 0.5) { "$accuracies" }
    device.close()

    val run = c.admin("POST", "/v1/admin/runs", schemaRun("kotlin-throwing", 1))
    val throwing = StarlingDevice(c.url, "kotlin-throwing", null, Files.createTempDirectory("starling-device").toString(), SHAPE)
    throwing.enroll(c.enrollmentToken("kotlin-throwing"))
    throwing.setTrainer(object : AppTrainer {
        override fun train(model: List<NamedTensor>, settings: TrainingSettings): TrainedTensors =
            throw TrainerException.Failed("the TFLite model file is missing")
        override fun evaluate(model: List<NamedTensor>): ModelMetrics? = null
    })
    val until = System.currentTimeMillis() + DEADLINE_MS
    while (true) {
        check(System.currentTimeMillis() < until) { "never selected within $DEADLINE_MS ms" }
        try {
            check(throwing.participate() is ParticipationOutcome.ComeBackLater)
            Thread.sleep(200)
        } catch (e: StarlingException.Training) {
            check("the TFLite model file is missing" in e.reason) { e.reason }
            break
        }
    }
    val rounds = c.admin("GET", "/v1/admin/runs/${field(run, "id")}/rounds")
    check(field(rounds, "n_reported") == "0") { rounds }
    check(throwing.status().uploads == 0uL)
    throwing.close()
}

fun main() {
    val tests = listOf(
        ::aDeviceParticipatesAndTheGlobalModelImproves,
        ::aDeviceUnpluggedAfterItsCheckInDoesNotTrain,
        ::badInputRaisesTypedExceptions,
        ::aKotlinTrainerTrainsARunOfNamedTensors,
    )
    var failed = 0
    Coordinator().use { c ->
        for (test in tests) {
            val started = System.currentTimeMillis()
            try {
                test(c)
                println("PASS ${test.name} (${System.currentTimeMillis() - started} ms)")
            } catch (e: Throwable) {
                failed += 1
                println("FAIL ${test.name}: $e")
                e.printStackTrace()
            }
        }
    }
    println("${tests.size - failed} passed, $failed failed")
    if (failed > 0) exitProcess(1)
}
