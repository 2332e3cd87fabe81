//! Hugging Face checkpoints (`config.json` and `model.safetensors`) of the GPT-2 and Llama
//! families as a Starling model spec and its values under Starling's tensor names: what
//! `starling models import-hf` stores as a base model. GPT-2 becomes embedding, learned
//! positions, `transformer_block`s (GELU's tanh form), a layer norm and a head; Llama becomes
//! embedding, `llama_block`s (RMS norm, rotary positions, grouped-query attention, SwiGLU),
//! an RMS norm and a head. The model predicts the token after the last of `length`.

use std::collections::HashMap;

use crate::model_spec::{FfnActivation, InputSpec, LayerSpec, ModelSpec};
use crate::tensor::{TensorSchema, f32_from_le_bytes, safetensors};

/// Why a checkpoint could not be imported.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum HfImportError {
    /// `config.json` is not JSON or lacks a field.
    #[error("config.json: {0}")]
    Config(String),
    /// The checkpoint is of an architecture or a variant Starling does not build.
    #[error("unsupported checkpoint: {0}")]
    Unsupported(String),
    /// `model.safetensors` could not be read.
    #[error("model.safetensors: {0}")]
    Safetensors(String),
    /// A tensor the architecture needs is missing or has another shape.
    #[error("tensor {name}: {why}")]
    Tensor {
        /// The checkpoint's tensor name.
        name: String,
        /// What is wrong.
        why: String,
    },
}

/// An imported checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Imported {
    /// The model, over `length` tokens of the checkpoint's vocabulary.
    pub spec: ModelSpec,
    /// The spec's tensors.
    pub schema: TensorSchema,
    /// Their values, in schema order.
    pub values: Vec<f32>,
}

/// The checkpoint's tensors by name: shape and values.
struct Checkpoint {
    tensors: HashMap<String, (Vec<u64>, Vec<f32>)>,
    /// `transformer.` for GPT-2 checkpoints saved from `GPT2LMHeadModel`, empty for the hub's.
    prefix: &'static str,
}

impl Checkpoint {
    fn get(&self, name: &str, shape: &[u64]) -> Result<&[f32], HfImportError> {
        let full = format!("{}{name}", self.prefix);
        match self.tensors.get(&full) {
            Some((s, v)) if s == shape => Ok(v),
            Some((s, _)) => Err(HfImportError::Tensor {
                name: full,
                why: format!("is {s:?}, the config makes it {shape:?}"),
            }),
            None => Err(HfImportError::Tensor { name: full, why: "missing".into() }),
        }
    }

    /// A `[rows, cols]` tensor transposed (PyTorch's `nn.Linear` keeps `[out, in]`, Starling's
    /// linear maps `[in, out]`).
    fn transposed(&self, name: &str, rows: u64, cols: u64) -> Result<Vec<f32>, HfImportError> {
        Ok(transpose(self.get(name, &[rows, cols])?, rows, cols))
    }
}

/// Imports a checkpoint: `config` is `config.json`'s text, `weights` the bytes of
/// `model.safetensors` (F32), `length` the tokens the model takes.
pub fn import(config: &str, weights: &[u8], length: u64) -> Result<Imported, HfImportError> {
    let config: serde_json::Value =
        serde_json::from_str(config).map_err(|e| HfImportError::Config(e.to_string()))?;
    let (schema, data) = safetensors::read_safetensors(weights)
        .map_err(|e| HfImportError::Safetensors(e.to_string()))?;
    let values = f32_from_le_bytes(&data);
    let mut tensors = HashMap::new();
    let mut at = 0;
    for t in schema.tensors {
        let n = t.numel() as usize;
        tensors.insert(t.name, (t.shape, values[at..at + n].to_vec()));
        at += n;
    }
    let model_type = config["model_type"].as_str().unwrap_or_default();
    let (spec, named) = match model_type {
        "gpt2" => {
            let prefix =
                if tensors.contains_key("transformer.wte.weight") { "transformer." } else { "" };
            gpt2(&Config(&config), &Checkpoint { tensors, prefix }, length)?
        }
        "llama" => llama(&Config(&config), &Checkpoint { tensors, prefix: "" }, length)?,
        other => {
            return Err(HfImportError::Unsupported(format!(
                "model_type {other:?}: Starling imports gpt2 and llama"
            )));
        }
    };
    let schema = spec.schema().map_err(|e| HfImportError::Unsupported(e.to_string()))?;
    let mut by_name: HashMap<String, Vec<f32>> = named.into_iter().collect();
    let mut values = Vec::with_capacity(schema.numel() as usize);
    for t in &schema.tensors {
        let v = by_name.remove(&t.name).unwrap_or_else(|| vec![0.0; t.numel() as usize]);
        debug_assert_eq!(v.len() as u64, t.numel(), "{}", t.name);
        values.extend(v);
    }
    debug_assert!(by_name.is_empty(), "names outside the schema: {:?}", by_name.keys());
    Ok(Imported { spec, schema, values })
}

/// Typed reads of `config.json`.
struct Config<'a>(&'a serde_json::Value);

impl Config<'_> {
    fn u64(&self, field: &str) -> Result<u64, HfImportError> {
        self.0[field]
            .as_u64()
            .filter(|&v| v > 0)
            .ok_or_else(|| HfImportError::Config(format!("{field} must be a positive integer")))
    }

    fn f64_or(&self, field: &str, default: f64) -> Result<f64, HfImportError> {
        match &self.0[field] {
            serde_json::Value::Null => Ok(default),
            v => {
                v.as_f64().ok_or_else(|| HfImportError::Config(format!("{field} must be a number")))
            }
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> bool {
        self.0[field].as_bool().unwrap_or(default)
    }

    fn str_or<'s>(&'s self, field: &str, default: &'s str) -> &'s str {
        self.0[field].as_str().unwrap_or(default)
    }
}

type Named = Vec<(String, Vec<f32>)>;

/// A row-major `[rows, cols]` matrix as `[cols, rows]`: a tied head is the embedding
/// `[vocab, width]` transposed.
pub(crate) fn transpose(v: &[f32], rows: u64, cols: u64) -> Vec<f32> {
    let (rows, cols) = (rows as usize, cols as usize);
    let mut out = vec![0f32; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

fn gpt2(
    config: &Config,
    ckpt: &Checkpoint,
    length: u64,
) -> Result<(ModelSpec, Named), HfImportError> {
    let (vocab, width) = (config.u64("vocab_size")?, config.u64("n_embd")?);
    let (blocks, heads) = (config.u64("n_layer")?, config.u64("n_head")?);
    let positions = config.u64("n_positions")?;
    let ffn = match config.0["n_inner"].as_u64() {
        Some(n) => n,
        None => 4 * width,
    };
    let activation = match config.str_or("activation_function", "gelu_new") {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => FfnActivation::GeluTanh,
        "gelu" => FfnActivation::Gelu,
        other => return Err(HfImportError::Unsupported(format!("activation_function {other:?}"))),
    };
    if (config.f64_or("layer_norm_epsilon", 1e-5)? - 1e-5).abs() > 1e-12 {
        return Err(HfImportError::Unsupported("layer_norm_epsilon other than 1e-5".into()));
    }
    if config.bool_or("scale_attn_by_inverse_layer_idx", false)
        || !config.bool_or("scale_attn_weights", true)
        || !config.bool_or("tie_word_embeddings", true)
    {
        return Err(HfImportError::Unsupported(
            "GPT-2 attention scaled other than by 1/√d, or an untied head".into(),
        ));
    }
    if length > positions {
        return Err(HfImportError::Unsupported(format!(
            "length {length} is more than the checkpoint's {positions} positions"
        )));
    }
    let mut layers = vec![LayerSpec::Embedding { dim: width }, LayerSpec::PositionEmbedding {}];
    let mut named: Named = vec![];
    let wte = ckpt.get("wte.weight", &[vocab, width])?;
    named.push(("layers.0.Embedding.weight".into(), wte.to_vec()));
    let wpe = ckpt.get("wpe.weight", &[positions, width])?;
    named.push((
        "layers.1.PositionEmbedding.weight".into(),
        wpe[..(length * width) as usize].to_vec(),
    ));
    for b in 0..blocks {
        let at = format!("layers.{}.TransformerBlock", layers.len());
        layers.push(LayerSpec::TransformerBlock { heads, width, ffn, dropout: 0.0, activation });
        let h = format!("h.{b}");
        let w = width as usize;
        for (ours, theirs) in [("norm_attention", "ln_1"), ("norm_ffn", "ln_2")] {
            named.push((
                format!("{at}.{ours}.gamma"),
                ckpt.get(&format!("{h}.{theirs}.weight"), &[width])?.to_vec(),
            ));
            named.push((
                format!("{at}.{ours}.beta"),
                ckpt.get(&format!("{h}.{theirs}.bias"), &[width])?.to_vec(),
            ));
        }
        // Conv1D keeps `[in, out]`, as Starling does; c_attn holds the query, key and value
        // maps side by side.
        let qkv = ckpt.get(&format!("{h}.attn.c_attn.weight"), &[width, 3 * width])?;
        let qkv_bias = ckpt.get(&format!("{h}.attn.c_attn.bias"), &[3 * width])?;
        for (k, name) in ["query", "key", "value"].into_iter().enumerate() {
            let weight: Vec<f32> =
                qkv.chunks_exact(3 * w).flat_map(|row| row[k * w..(k + 1) * w].to_vec()).collect();
            named.push((format!("{at}.{name}.weight"), weight));
            named.push((format!("{at}.{name}.bias"), qkv_bias[k * w..(k + 1) * w].to_vec()));
        }
        for (ours, theirs, fan_in, out) in [
            ("output", "attn.c_proj", width, width),
            ("ffn_inner", "mlp.c_fc", width, ffn),
            ("ffn_outer", "mlp.c_proj", ffn, width),
        ] {
            named.push((
                format!("{at}.{ours}.weight"),
                ckpt.get(&format!("{h}.{theirs}.weight"), &[fan_in, out])?.to_vec(),
            ));
            named.push((
                format!("{at}.{ours}.bias"),
                ckpt.get(&format!("{h}.{theirs}.bias"), &[out])?.to_vec(),
            ));
        }
    }
    let norm = format!("layers.{}.LayerNorm", layers.len());
    layers.push(LayerSpec::LayerNorm {});
    named.push((format!("{norm}.gamma"), ckpt.get("ln_f.weight", &[width])?.to_vec()));
    named.push((format!("{norm}.beta"), ckpt.get("ln_f.bias", &[width])?.to_vec()));
    layers.push(LayerSpec::LastStep {});
    named.push((format!("layers.{}.Linear.weight", layers.len()), transpose(wte, vocab, width)));
    layers.push(LayerSpec::Linear { out: vocab });
    let spec = ModelSpec { input: InputSpec::Tokens { vocab, length }, layers, lora: None };
    Ok((spec, named))
}

fn llama(
    config: &Config,
    ckpt: &Checkpoint,
    length: u64,
) -> Result<(ModelSpec, Named), HfImportError> {
    let (vocab, width) = (config.u64("vocab_size")?, config.u64("hidden_size")?);
    let (blocks, heads) = (config.u64("num_hidden_layers")?, config.u64("num_attention_heads")?);
    let kv_heads = match config.0["num_key_value_heads"].as_u64() {
        Some(n) => n,
        None => heads,
    };
    let ffn = config.u64("intermediate_size")?;
    let norm_eps = config.f64_or("rms_norm_eps", 1e-6)?;
    if config.str_or("hidden_act", "silu") != "silu" {
        return Err(HfImportError::Unsupported("hidden_act other than silu".into()));
    }
    if !width.is_multiple_of(heads)
        || config.0["head_dim"].as_u64().is_some_and(|d| d * heads != width)
    {
        return Err(HfImportError::Unsupported("a head_dim other than hidden_size / heads".into()));
    }
    // transformers 5 nests the rotary settings in `rope_parameters`; earlier ones kept
    // `rope_theta` and `rope_scaling` at the top level.
    let rope = match &config.0["rope_parameters"] {
        serde_json::Value::Null => config.0.clone(),
        nested => nested.clone(),
    };
    let rope = Config(&rope);
    let rope_type = rope.str_or("rope_type", "default");
    if rope_type != "default" || !config.0["rope_scaling"].is_null() {
        return Err(HfImportError::Unsupported(format!("rope scaling ({rope_type})")));
    }
    let rope_theta = rope.f64_or("rope_theta", 10_000.0)?;
    let (attention_bias, mlp_bias) =
        (config.bool_or("attention_bias", false), config.bool_or("mlp_bias", false));
    let positions = config.u64("max_position_embeddings")?;
    if length > positions {
        return Err(HfImportError::Unsupported(format!(
            "length {length} is more than the checkpoint's {positions} positions"
        )));
    }
    let mut layers = vec![LayerSpec::Embedding { dim: width }];
    let mut named: Named = vec![];
    let embedding = ckpt.get("model.embed_tokens.weight", &[vocab, width])?;
    named.push(("layers.0.Embedding.weight".into(), embedding.to_vec()));
    let kv_width = width / heads * kv_heads;
    for b in 0..blocks {
        let at = format!("layers.{}.LlamaBlock", layers.len());
        layers.push(LayerSpec::LlamaBlock { heads, kv_heads, width, ffn, rope_theta, norm_eps });
        let l = format!("model.layers.{b}");
        named.push((
            format!("{at}.norm_attention.gamma"),
            ckpt.get(&format!("{l}.input_layernorm.weight"), &[width])?.to_vec(),
        ));
        named.push((
            format!("{at}.norm_ffn.gamma"),
            ckpt.get(&format!("{l}.post_attention_layernorm.weight"), &[width])?.to_vec(),
        ));
        for (ours, theirs, fan_in, out, bias) in [
            ("query", "self_attn.q_proj", width, width, attention_bias),
            ("key", "self_attn.k_proj", width, kv_width, attention_bias),
            ("value", "self_attn.v_proj", width, kv_width, attention_bias),
            ("output", "self_attn.o_proj", width, width, attention_bias),
            ("ffn_gate", "mlp.gate_proj", width, ffn, mlp_bias),
            ("ffn_up", "mlp.up_proj", width, ffn, mlp_bias),
            ("ffn_down", "mlp.down_proj", ffn, width, mlp_bias),
        ] {
            let weight = ckpt.transposed(&format!("{l}.{theirs}.weight"), out, fan_in)?;
            named.push((format!("{at}.{ours}.weight"), weight));
            if bias {
                let bias = ckpt.get(&format!("{l}.{theirs}.bias"), &[out])?;
                named.push((format!("{at}.{ours}.bias"), bias.to_vec()));
            }
        }
    }
    let norm = layers.len();
    layers.push(LayerSpec::RmsNorm { eps: norm_eps });
    named.push((
        format!("layers.{norm}.RmsNorm.gamma"),
        ckpt.get("model.norm.weight", &[width])?.to_vec(),
    ));
    layers.push(LayerSpec::LastStep {});
    let weight = if config.bool_or("tie_word_embeddings", false) {
        transpose(embedding, vocab, width)
    } else {
        ckpt.transposed("lm_head.weight", vocab, width)?
    };
    named.push((format!("layers.{}.Linear.weight", layers.len()), weight));
    layers.push(LayerSpec::Linear { out: vocab });
    let spec = ModelSpec { input: InputSpec::Tokens { vocab, length }, layers, lora: None };
    Ok((spec, named))
}
