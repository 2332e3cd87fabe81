//! A GPT-2 or Llama model back out to Hugging Face: the merged model as a checkpoint
//! `transformers` loads (`config.json` + `model.safetensors`), and a LoRA run's adapters as
//! PEFT's (`adapter_config.json` + `adapter_model.safetensors`), under their names. The
//! inverse of [`crate::hf_import`] for the specs it makes.

mod gpt2;

use std::collections::BTreeMap;

use crate::hf_import::transpose;
use crate::model_spec::{InputSpec, LayerSpec, LoraSpec, ModelSpec};
use crate::tensor::{DType, TensorSchema, TensorSpec, f32_to_le_bytes, safetensors};

/// Why a model could not be exported in Hugging Face's form.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum HfExportError {
    /// The spec is not one `starling models import-hf` makes of a GPT-2 or Llama checkpoint.
    #[error("not a spec of a GPT-2 or Llama checkpoint: {0}")]
    NotImported(String),
    /// The model has something a Hugging Face model cannot hold.
    #[error("{0}")]
    Unrepresentable(String),
    /// The run has no LoRA adapters to export.
    #[error("the run's spec has no LoRA adapters")]
    NoAdapters,
    /// The values do not match the spec.
    #[error("{0}")]
    Values(String),
}

/// Files to write, by name.
pub type Files = BTreeMap<&'static str, Vec<u8>>;

/// The spec's shape as a Llama: its blocks' settings, and where each layer is.
struct Llama {
    vocab: u64,
    width: u64,
    ffn: u64,
    heads: u64,
    kv_heads: u64,
    rope_theta: f64,
    norm_eps: f64,
    length: u64,
    /// Spec layer index of each block, in order.
    blocks: Vec<usize>,
    norm: usize,
    head: usize,
}

/// Where a spec `import-hf` made keeps its parts: `(vocab, length, final norm, head)`, once it
/// is over tokens, starts with an embedding (and `first_block - 1` more layers `starts` accepts)
/// and ends in a norm `is_norm` accepts, `last_step` and a head over the vocabulary.
fn frame(
    spec: &ModelSpec,
    first_block: usize,
    starts: impl Fn(&[LayerSpec]) -> bool,
    is_norm: impl Fn(&LayerSpec) -> bool,
) -> Result<(u64, u64, usize, usize), HfExportError> {
    let not = |why: &str| HfExportError::NotImported(why.to_owned());
    let InputSpec::Tokens { vocab, length } = spec.input else {
        return Err(not("its input is not tokens"));
    };
    let layers = &spec.layers;
    let n = layers.len();
    if n < first_block + 4 || !starts(&layers[..first_block]) {
        return Err(not("it does not start as an imported checkpoint does"));
    }
    let (norm, head) = (n - 3, n - 1);
    let (LayerSpec::LastStep {}, LayerSpec::Linear { out }) = (layers[n - 2], layers[head]) else {
        return Err(not("it does not end in last_step, linear"));
    };
    if !is_norm(&layers[norm]) || out != vocab {
        return Err(not("its head is not a norm and a map onto the vocabulary"));
    }
    Ok((vocab, length, norm, head))
}

fn llama(spec: &ModelSpec) -> Result<Llama, HfExportError> {
    let not = |why: &str| HfExportError::NotImported(why.to_owned());
    let (vocab, length, norm, head) = frame(
        spec,
        1,
        |first| matches!(first, [LayerSpec::Embedding { .. }]),
        |l| matches!(l, LayerSpec::RmsNorm { .. }),
    )?;
    let layers = &spec.layers;
    let mut settings = None;
    for layer in &layers[1..norm] {
        let LayerSpec::LlamaBlock { heads, kv_heads, width, ffn, rope_theta, norm_eps } = *layer
        else {
            return Err(not("a layer between the embedding and the norm is not a llama_block"));
        };
        let these = (heads, kv_heads, width, ffn, rope_theta.to_bits(), norm_eps.to_bits());
        if settings.is_some_and(|s| s != these) {
            return Err(not("its blocks differ in shape"));
        }
        settings = Some(these);
    }
    let Some((heads, kv_heads, width, ffn, theta, eps)) = settings else {
        return Err(not("it has no llama_block"));
    };
    let LayerSpec::RmsNorm { eps: final_eps } = layers[norm] else { unreachable!() };
    if final_eps.to_bits() != eps {
        return Err(not("its final norm's eps differs from its blocks'"));
    }
    Ok(Llama {
        vocab,
        width,
        ffn,
        heads,
        kv_heads,
        rope_theta: f64::from_bits(theta),
        norm_eps: f64::from_bits(eps),
        length,
        blocks: (1..norm).collect(),
        norm,
        head,
    })
}

/// A Starling linear map's Hugging Face module, by its field name in a Llama block.
fn module_of(field: &str) -> Option<&'static str> {
    Some(match field {
        "query" => "self_attn.q_proj",
        "key" => "self_attn.k_proj",
        "value" => "self_attn.v_proj",
        "output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    })
}

/// A tensor's shape and values.
type Shaped<'v> = (Vec<u64>, &'v [f32]);

/// The spec's tensors by name, each with its shape and values.
fn by_name<'v>(
    spec: &ModelSpec,
    values: &'v [f32],
) -> Result<BTreeMap<String, Shaped<'v>>, HfExportError> {
    let schema = spec.schema().map_err(|e| HfExportError::Values(e.to_string()))?;
    if schema.numel() != values.len() as u64 {
        return Err(HfExportError::Values(format!(
            "{} values for a model of {}",
            values.len(),
            schema.numel()
        )));
    }
    let mut out = BTreeMap::new();
    let mut at = 0;
    for t in schema.tensors {
        let n = t.numel() as usize;
        out.insert(t.name, (t.shape, &values[at..at + n]));
        at += n;
    }
    Ok(out)
}

/// Named tensors as a safetensors file, in name order.
fn safetensors_file(tensors: BTreeMap<String, (Vec<u64>, Vec<f32>)>) -> Vec<u8> {
    let mut schema = TensorSchema { tensors: vec![] };
    let mut data = vec![];
    for (name, (shape, values)) in tensors {
        schema.tensors.push(TensorSpec { name, shape, dtype: DType::F32 });
        data.extend(values);
    }
    let metadata = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::to_safetensors(&schema, &f32_to_le_bytes(&data), &metadata)
}

/// Whether `spec` is a Llama's (else it may be GPT-2's).
fn is_llama(spec: &ModelSpec) -> bool {
    spec.layers.iter().any(|l| matches!(l, LayerSpec::LlamaBlock { .. }))
}

/// The merged model (`spec` without adapters, `values` of that spec) as a Hugging Face GPT-2
/// or Llama checkpoint: `config.json` and `model.safetensors`.
pub fn checkpoint(spec: &ModelSpec, values: &[f32]) -> Result<Files, HfExportError> {
    if spec.lora.is_some() {
        return Err(HfExportError::Values(
            "merge the adapters first (ModelSpec::merge_lora)".into(),
        ));
    }
    if !is_llama(spec) {
        return gpt2::checkpoint(spec, values);
    }
    let l = llama(spec)?;
    let named = by_name(spec, values)?;
    let get = |name: &str| named.get(name).expect("the spec names it");
    let mut out = BTreeMap::new();
    let (embedding_shape, embedding) = get("layers.0.Embedding.weight");
    out.insert("model.embed_tokens.weight".into(), (embedding_shape.clone(), embedding.to_vec()));
    // A Hugging Face Llama has biases on all four attention maps or none, and on all three
    // feed-forward maps or none: any non-zero one turns its group's on.
    let nonzero = |fields: &[&str]| {
        l.blocks.iter().any(|b| {
            fields.iter().any(|f| {
                get(&format!("layers.{b}.LlamaBlock.{f}.bias")).1.iter().any(|v| *v != 0.0)
            })
        })
    };
    let attention_bias = nonzero(&["query", "key", "value", "output"]);
    let mlp_bias = nonzero(&["ffn_gate", "ffn_up", "ffn_down"]);
    for (k, b) in l.blocks.iter().enumerate() {
        let ours = format!("layers.{b}.LlamaBlock");
        let theirs = format!("model.layers.{k}");
        for (norm, hf) in
            [("norm_attention", "input_layernorm"), ("norm_ffn", "post_attention_layernorm")]
        {
            let (shape, v) = get(&format!("{ours}.{norm}.gamma"));
            out.insert(format!("{theirs}.{hf}.weight"), (shape.clone(), v.to_vec()));
        }
        for field in ["query", "key", "value", "output", "ffn_gate", "ffn_up", "ffn_down"] {
            let module = module_of(field).expect("a Llama block's map");
            let (shape, w) = get(&format!("{ours}.{field}.weight"));
            let (fan_in, fan_out) = (shape[0], shape[1]);
            out.insert(
                format!("{theirs}.{module}.weight"),
                (vec![fan_out, fan_in], transpose(w, fan_in, fan_out)),
            );
            let with_bias = if module.starts_with("mlp") { mlp_bias } else { attention_bias };
            if with_bias {
                let (shape, v) = get(&format!("{ours}.{field}.bias"));
                out.insert(format!("{theirs}.{module}.bias"), (shape.clone(), v.to_vec()));
            }
        }
    }
    let (shape, v) = get(&format!("layers.{}.RmsNorm.gamma", l.norm));
    out.insert("model.norm.weight".into(), (shape.clone(), v.to_vec()));
    let (_, head_bias) = get(&format!("layers.{}.Linear.bias", l.head));
    if head_bias.iter().any(|v| *v != 0.0) {
        return Err(HfExportError::Unrepresentable(
            "the head's bias is not zero: a Hugging Face Llama's lm_head has none".into(),
        ));
    }
    let (_, head) = get(&format!("layers.{}.Linear.weight", l.head));
    out.insert(
        "lm_head.weight".into(),
        (vec![l.vocab, l.width], transpose(head, l.width, l.vocab)),
    );
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": l.vocab,
        "hidden_size": l.width,
        "intermediate_size": l.ffn,
        "num_hidden_layers": l.blocks.len(),
        "num_attention_heads": l.heads,
        "num_key_value_heads": l.kv_heads,
        "head_dim": l.width / l.heads,
        "hidden_act": "silu",
        "max_position_embeddings": l.length,
        "rms_norm_eps": l.norm_eps,
        "rope_theta": l.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": l.rope_theta},
        "attention_bias": attention_bias,
        "mlp_bias": mlp_bias,
        "tie_word_embeddings": false,
        "torch_dtype": "float32",
    });
    Ok(BTreeMap::from([
        ("config.json", serde_json::to_vec_pretty(&config).expect("JSON")),
        ("model.safetensors", safetensors_file(out)),
    ]))
}

/// A LoRA run's adapters (`spec` with its `lora`, `values` of that spec) as PEFT's:
/// `adapter_config.json` and `adapter_model.safetensors`, loadable with
/// `PeftModel.from_pretrained` onto the checkpoint the run started from.
pub fn peft_adapters(spec: &ModelSpec, values: &[f32]) -> Result<Files, HfExportError> {
    let lora = spec.lora.as_ref().ok_or(HfExportError::NoAdapters)?;
    if !is_llama(spec) {
        return gpt2::peft_adapters(spec, lora, values);
    }
    let l = llama(&spec.without_lora())?;
    let named = by_name(spec, values)?;
    let mut adapters = PeftAdapters::new(lora);
    let block_of = |i: usize| l.blocks.iter().position(|&b| b == i);
    for path in spec.linear_paths() {
        if spec.lora_rank(&path).is_none() {
            continue;
        }
        // `layers.{i}.LlamaBlock.{field}` or the head, `layers.{i}.Linear`.
        let parts: Vec<&str> = path.split('.').collect();
        let layer: usize = parts[1].parse().expect("a layer index");
        let module = match (block_of(layer), parts.get(3)) {
            (Some(k), Some(field)) => {
                format!("model.layers.{k}.{}", module_of(field).expect("a Llama block's map"))
            }
            _ if layer == l.head => "lm_head".to_owned(),
            _ => return Err(HfExportError::NotImported(format!("adapters on {path}"))),
        };
        let (a_shape, a) = &named[&format!("{path}.lora_a")];
        let (b_shape, b) = &named[&format!("{path}.lora_b")];
        adapters.add(module, a, b, [a_shape[0], a_shape[1], b_shape[1]]);
    }
    Ok(adapters.files(false))
}

/// PEFT's adapter files in the making: each adapted module's `lora_A` and `lora_B` and the
/// config naming them.
struct PeftAdapters<'l> {
    lora: &'l LoraSpec,
    tensors: BTreeMap<String, (Vec<u64>, Vec<f32>)>,
    targets: Vec<String>,
    rank_pattern: serde_json::Map<String, serde_json::Value>,
    alpha_pattern: serde_json::Map<String, serde_json::Value>,
}

impl<'l> PeftAdapters<'l> {
    fn new(lora: &'l LoraSpec) -> Self {
        PeftAdapters {
            lora,
            tensors: BTreeMap::new(),
            targets: vec![],
            rank_pattern: serde_json::Map::new(),
            alpha_pattern: serde_json::Map::new(),
        }
    }

    /// The adapter of `module`: Starling's `A` `[in, rank]` and `B` `[rank, out]` become PEFT's
    /// `lora_A` `[rank, in]` and `lora_B` `[out, rank]`, both `nn.Linear` weights. A rank other
    /// than the spec's (GPT-2's fused `c_attn`, a multiple of it) keeps the scale `alpha / r`
    /// through `rank_pattern` and `alpha_pattern`.
    fn add(&mut self, module: String, a: &[f32], b: &[f32], [fan_in, rank, fan_out]: [u64; 3]) {
        self.tensors.insert(
            format!("base_model.model.{module}.lora_A.weight"),
            (vec![rank, fan_in], transpose(a, fan_in, rank)),
        );
        self.tensors.insert(
            format!("base_model.model.{module}.lora_B.weight"),
            (vec![fan_out, rank], transpose(b, rank, fan_out)),
        );
        if rank != self.lora.rank {
            let times = (rank / self.lora.rank) as f64;
            self.rank_pattern.insert(module.clone(), rank.into());
            self.alpha_pattern.insert(module.clone(), (self.lora.alpha * times).into());
        }
        self.targets.push(module);
    }

    /// `adapter_config.json` and `adapter_model.safetensors`; `fan_in_fan_out` for a model whose
    /// maps keep `[in, out]` (GPT-2's Conv1D).
    fn files(self, fan_in_fan_out: bool) -> Files {
        let config = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.lora.rank,
            "lora_alpha": self.lora.alpha,
            "rank_pattern": self.rank_pattern,
            "alpha_pattern": self.alpha_pattern,
            // Whole module names: PEFT adapts a module whose name ends in one of them.
            "target_modules": self.targets,
            "lora_dropout": 0.0,
            "bias": "none",
            // PEFT turns this off itself for an `nn.Linear` such as GPT-2's lm_head.
            "fan_in_fan_out": fan_in_fan_out,
            "use_rslora": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": null,
            "base_model_name_or_path": null,
        });
        BTreeMap::from([
            ("adapter_config.json", serde_json::to_vec_pretty(&config).expect("JSON")),
            ("adapter_model.safetensors", safetensors_file(self.tensors)),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(layers: serde_json::Value) -> ModelSpec {
        serde_json::from_value(serde_json::json!({
            "input": {"kind": "tokens", "vocab": 10, "length": 4}, "layers": layers
        }))
        .unwrap()
    }

    #[test]
    fn what_a_hugging_face_model_cannot_hold_is_refused_by_what_it_is() {
        let lstm = spec(serde_json::json!([{"kind": "embedding", "dim": 4},
            {"kind": "lstm", "hidden": 4}, {"kind": "last_step"}, {"kind": "linear", "out": 10}]));
        let values = lstm.initial_parameters(0).unwrap();
        assert!(matches!(checkpoint(&lstm, &values), Err(HfExportError::NotImported(_))));
        let llama = spec(serde_json::json!([{"kind": "embedding", "dim": 4},
            {"kind": "llama_block", "heads": 2, "kv_heads": 1, "width": 4, "ffn": 8},
            {"kind": "rms_norm"}, {"kind": "last_step"}, {"kind": "linear", "out": 10}]));
        let mut values = llama.initial_parameters(0).unwrap();
        assert!(checkpoint(&llama, &values).is_ok());
        assert_eq!(peft_adapters(&llama, &values), Err(HfExportError::NoAdapters));
        // The head's bias is the last tensor: Hugging Face's lm_head has none.
        *values.last_mut().unwrap() = 1.0;
        assert!(matches!(checkpoint(&llama, &values), Err(HfExportError::Unrepresentable(_))));
        assert!(matches!(checkpoint(&llama, &values[1..]), Err(HfExportError::Values(_))));
    }
}
