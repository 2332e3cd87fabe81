// The sample app: adds examples it makes on the device (a stand-in for the app's own data),
// participates in rounds off the main thread, and shows the global model's accuracy.
import Starling
import SwiftUI

@main
struct StarlingSampleApp: App {
    var body: some Scene { WindowGroup { ContentView() } }
}

final class Progress: ProgressListener {
    func onPhase(phase: String) { print("phase:", phase) }
    func onStep(epoch: UInt32, batch: UInt32, batches: UInt32, loss: Double) {}
}

struct ContentView: View {
    @State private var lines: [String] = []

    var body: some View {
        List(lines, id: \.self) { Text($0) }.task { await train() }
    }

    func train() async {
        let storage = FileManager.default.urls(for: .applicationSupportDirectory, in: .userDomainMask)[0]
            .appendingPathComponent("starling").path
        do {
            let device = try StarlingDevice(
                coordinatorUrl: ProcessInfo.processInfo.environment["STARLING_URL"] ?? "http://127.0.0.1:8080",
                population: "default", credential: nil, storageDir: storage,
                shape: .image(channels: 1, height: 8, width: 8))
            if !device.status().enrolled {
                _ = try device.enroll(enrollmentToken: ProcessInfo.processInfo.environment["STARLING_ENROLLMENT_TOKEN"] ?? "")
            }
            // 8x8 "images" with a bright row whose index is the label.
            var labels: [UInt32] = [], features: [Float] = []
            for _ in 0..<400 {
                let label = UInt32.random(in: 0..<8)
                labels.append(label)
                features += (0..<64).map { $0 / 8 == Int(label) ? 1 : Float.random(in: 0..<0.2) }
            }
            try device.addExamples(features: features, labels: labels)
            device.setProgressListener(listener: Progress())
            while true {
                // participate() blocks: keep it off the main actor.
                let outcome = try await Task.detached { try device.participate() }.value
                switch outcome {
                case let .uploaded(_, roundIdx, trainLoss, evaluation):
                    lines.append("round \(roundIdx): loss \(trainLoss), accuracy \(evaluation?.accuracy ?? .nan)")
                case let .comeBackLater(afterSecs):
                    try await Task.sleep(nanoseconds: afterSecs * 1_000_000_000)
                case let .roundMissed(_, roundIdx):
                    lines.append("round \(roundIdx) missed")
                }
            }
        } catch {
            lines.append("stopped: \(error)")
        }
    }
}
