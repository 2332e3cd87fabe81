// A stub of `android.content.Context` for type-checking the sample (see Activity.kt).
package android.content

open class Context
