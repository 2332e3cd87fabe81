// A stub of `android.view.View` for type-checking the sample (see Activity.kt).
package android.view

open class View(context: android.content.Context)
