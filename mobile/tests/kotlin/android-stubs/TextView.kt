// A stub of `android.widget.TextView` for type-checking the sample (see Activity.kt).
package android.widget

class TextView(context: android.content.Context) : android.view.View(context) {
    fun append(text: CharSequence) {}
}
