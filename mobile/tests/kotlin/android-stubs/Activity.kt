// The few `android.*` declarations the sample app uses, with their Android signatures and no
// behaviour: enough to type-check the sample against the generated bindings without the
// Android SDK (`cargo xtask test` compiles them together; nothing here runs).
package android.app

open class Activity : android.content.Context() {
    open fun onCreate(savedInstanceState: android.os.Bundle?) {}

    fun setContentView(view: android.view.View) {}

    fun runOnUiThread(action: Runnable) {}

    val filesDir: java.io.File
        get() = java.io.File(".")
}
