//! The plan's `model` section: a schema, a spec or both, which tensors train and stay local,
//! and how version 0 is made.

use crate::model_spec::InputSpec;
use crate::tensor::TensorSchema;

use super::{InitSpec, ModelKind, ModelParts, ModelPlan, PlanError, field};

impl ModelPlan {
    /// The model's schema (the spec's, when both agree) and its split into update, local and
    /// frozen tensors.
    pub(super) fn resolve(&self) -> Result<(TensorSchema, ModelParts), PlanError> {
        match (self.kind, &self.schema, &self.spec) {
            (Some(ModelKind::Tensors), _, Some(_)) => {
                return Err(field(
                    "model.spec",
                    "a model of kind tensors has no spec: its devices' trainers define it",
                ));
            }
            (Some(ModelKind::Tensors), None, None) => {
                return Err(field("model.schema", "a model of kind tensors needs its schema"));
            }
            (Some(ModelKind::Layers), _, None) => {
                return Err(field("model.spec", "a model of kind layers needs its spec"));
            }
            _ => {}
        }
        let schema = match (&self.schema, &self.spec) {
            (None, None) => return Err(field("model", "needs a schema, a spec, or both")),
            (Some(schema), None) => schema.clone(),
            (None, Some(spec)) => spec.schema()?,
            (Some(schema), Some(spec)) => {
                if spec.schema()? != *schema {
                    return Err(field("model.schema", "does not match the schema of model.spec"));
                }
                schema.clone()
            }
        };
        schema.validate()?;
        self.check_tokenizer()?;
        // A LoRA model trains its adapters alone unless the plan says otherwise.
        let lora_adapters = || vec!["*.lora_a".to_owned(), "*.lora_b".to_owned()];
        let trainable = self
            .trainable
            .clone()
            .or_else(|| self.spec.as_ref().and_then(|s| s.lora.as_ref()).map(|_| lora_adapters()));
        let parts = ModelParts::resolve(&schema, trainable.as_deref(), &self.local)?;
        Ok((schema, parts))
    }

    /// A tokenizer is named by a content hash, for a model the SDK builds over tokens.
    fn check_tokenizer(&self) -> Result<(), PlanError> {
        let Some(hash) = &self.tokenizer else { return Ok(()) };
        if !is_content_hash(hash) {
            return Err(field(
                "model.tokenizer",
                "must be a content hash: 64 lowercase hex digits",
            ));
        }
        match self.spec.as_ref().map(|s| s.input) {
            Some(InputSpec::Tokens { .. }) => Ok(()),
            _ => Err(field(
                "model.tokenizer",
                "needs a model spec whose input is tokens: the SDK tokenizes for the model it builds",
            )),
        }
    }

    /// Initial parameters given inline must be the schema's length; their values are checked
    /// when `initial_parameters` decodes them.
    pub(super) fn check_init_length(&self, schema: &TensorSchema) -> Result<(), PlanError> {
        if let InitSpec::Parameters { data_base64 } = &self.init {
            let bytes = data_base64.len() / 4 * 3;
            if bytes.abs_diff(schema.byte_len() as usize) > 2 {
                return Err(field("model.init.data_base64", "length does not match the schema"));
            }
        }
        Ok(())
    }
}

/// Whether `s` is a content hash as the store addresses imports by: SHA-256, 64 lowercase hex
/// digits.
pub fn is_content_hash(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}
