// Android build of the Starling bindings: the :starling library and the :sample app.
pluginManagement {
    repositories { google(); mavenCentral(); gradlePluginPortal() }
}
dependencyResolutionManagement {
    repositories { google(); mavenCentral() }
}
rootProject.name = "starling-android"
include(":starling", ":sample")
