// A stub of `android.os.Bundle` for type-checking the sample (see Activity.kt).
package android.os

class Bundle
