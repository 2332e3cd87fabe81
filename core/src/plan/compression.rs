//! The plan's `compression` (uploads) and `model_download` (downloads) encodings.

use super::{Plan, PlanError, field};

impl Plan {
    /// Each encoding's own parameters (block sizes, k), when it is not plain f32.
    pub(super) fn check_compression(&self) -> Result<(), PlanError> {
        if !self.compression.is_f32() {
            self.compression.check().map_err(|e| field("compression", e.to_string()))?;
        }
        if !self.model_download.is_f32() {
            self.model_download
                .check_model()
                .map_err(|e| field("model_download", e.to_string()))?;
        }
        Ok(())
    }
}
