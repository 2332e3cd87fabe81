// What the Gradle build generates from the sample's build.gradle.kts `buildConfigField`s, for
// type-checking the sample (see Activity.kt).
package dev.starling.sample

object BuildConfig {
    const val COORDINATOR_URL = "http://10.0.2.2:8080"
    const val ENROLLMENT_TOKEN = ""
}
