//! `uniffi-bindgen generate --library target/debug/libstarling_mobile.so --language kotlin|swift|python`.

fn main() {
    uniffi::uniffi_bindgen_main()
}
