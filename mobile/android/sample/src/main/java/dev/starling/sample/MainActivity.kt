// The sample app: adds examples it generates on the device (a stand-in for the app's own data),
// then participates in rounds on a background thread and shows progress and accuracy.
package dev.starling.sample

import android.app.Activity
import android.os.Bundle
import android.widget.TextView
import kotlin.concurrent.thread
import uniffi.starling_mobile.ExampleShape
import uniffi.starling_mobile.ParticipationOutcome
import uniffi.starling_mobile.ProgressListener
import uniffi.starling_mobile.StarlingDevice
import uniffi.starling_mobile.StarlingException

class MainActivity : Activity() {
    private lateinit var log: TextView

    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        log = TextView(this).also { setContentView(it) }
        thread { train() }
    }

    private fun show(line: String) = runOnUiThread { log.append(line + "\n") }

    private fun train() {
        val device = StarlingDevice(
            BuildConfig.COORDINATOR_URL, "default", null, filesDir.path + "/starling",
            ExampleShape.Image(1uL, 8uL, 8uL),
        )
        try {
            if (!device.status().enrolled) device.enroll(BuildConfig.ENROLLMENT_TOKEN)
            // 8x8 "images" of a bright row whose index is the label: learnable, and made here.
            val random = java.util.Random(1)
            val labels = List(400) { random.nextInt(8).toUInt() }
            val features = labels.flatMap { label ->
                List(64) { i -> if (i / 8 == label.toInt()) 1f else random.nextFloat() * 0.2f }
            }
            device.addExamples(features, labels)
            device.setProgressListener(object : ProgressListener {
                override fun onPhase(phase: String) = show("phase: $phase")
                override fun onStep(epoch: UInt, batch: UInt, batches: UInt, loss: Double) {}
            })
            while (true) {
                when (val outcome = device.participate()) {
                    is ParticipationOutcome.Uploaded -> show(
                        "round ${outcome.roundIdx}: loss %.4f, global accuracy %s".format(
                            outcome.trainLoss, outcome.evaluation?.accuracy ?: "-"))
                    is ParticipationOutcome.Evaluated -> show(
                        "round ${outcome.roundIdx}: evaluated, accuracy %.3f".format(outcome.evaluation.accuracy))
                    is ParticipationOutcome.ComeBackLater -> Thread.sleep(outcome.afterSecs.toLong() * 1000)
                    is ParticipationOutcome.RoundMissed -> show("round ${outcome.roundIdx} missed")
                    // Unplugged (or off Wi-Fi) since the check-in: nothing was trained.
                    is ParticipationOutcome.ConditionsNotMet -> show("round ${outcome.roundIdx}: waiting for ${outcome.unmet}")
                }
            }
        } catch (e: StarlingException) {
            show("stopped: ${e.message}")
        }
    }
}
