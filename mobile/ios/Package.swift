// swift-tools-version:5.9
// The Starling Swift package: UniFFI's generated Swift (Sources/Starling) over the Rust library
// packaged as StarlingFFI.xcframework by build-xcframework.sh.
import PackageDescription

let package = Package(
    name: "Starling",
    platforms: [.iOS(.v15), .macOS(.v12)],
    products: [.library(name: "Starling", targets: ["Starling"])],
    targets: [
        .binaryTarget(name: "StarlingFFI", path: "StarlingFFI.xcframework"),
        .target(name: "Starling", dependencies: ["StarlingFFI"], path: "Sources/Starling"),
    ]
)
