// A minimal app that trains on examples it provides and shows the global model's accuracy.
plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

android {
    namespace = "dev.starling.sample"
    compileSdk = 35
    defaultConfig {
        applicationId = "dev.starling.sample"
        minSdk = 26
        targetSdk = 35
        versionCode = 1
        versionName = "0.1.0"
        // Set in gradle.properties or the environment: where the coordinator is, and a token.
        buildConfigField("String", "COORDINATOR_URL", "\"${System.getenv("STARLING_URL") ?: "http://10.0.2.2:8080"}\"")
        buildConfigField("String", "ENROLLMENT_TOKEN", "\"${System.getenv("STARLING_ENROLLMENT_TOKEN") ?: ""}\"")
    }
    buildFeatures { buildConfig = true }
    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }
    kotlinOptions { jvmTarget = "17" }
}

dependencies {
    implementation(project(":starling"))
    implementation("org.jetbrains.kotlinx:kotlinx-coroutines-android:1.9.0")
}
