//! GPT-2's side of the export: Starling's separate query, key and value maps go back into
//! GPT-2's fused `c_attn` (and their adapters into one adapter of it), every other map keeps
//! Conv1D's `[in, out]` layout, which is Starling's.

use std::collections::BTreeMap;

use super::{Files, HfExportError, PeftAdapters, by_name, frame, safetensors_file};
use crate::hf_import::transpose;
use crate::model_spec::{FfnActivation, LayerSpec, LoraSpec, ModelSpec};

/// The spec's shape as a GPT-2.
struct Gpt2 {
    vocab: u64,
    width: u64,
    ffn: u64,
    heads: u64,
    length: u64,
    activation: FfnActivation,
    /// Spec layer index of each block, in order.
    blocks: Vec<usize>,
    norm: usize,
    head: usize,
}

fn shape(spec: &ModelSpec) -> Result<Gpt2, HfExportError> {
    let not = |why: &str| HfExportError::NotImported(why.to_owned());
    let (vocab, length, norm, head) = frame(
        spec,
        2,
        |first| matches!(first, [LayerSpec::Embedding { .. }, LayerSpec::PositionEmbedding {}]),
        |l| matches!(l, LayerSpec::LayerNorm {}),
    )?;
    let layers = &spec.layers;
    let mut settings = None;
    for layer in &layers[2..norm] {
        let LayerSpec::TransformerBlock { heads, width, ffn, activation, .. } = *layer else {
            return Err(not(
                "a layer between the positions and the norm is not a transformer_block",
            ));
        };
        if settings.is_some_and(|s| s != (heads, width, ffn, activation)) {
            return Err(not("its blocks differ in shape"));
        }
        settings = Some((heads, width, ffn, activation));
    }
    let Some((heads, width, ffn, activation)) = settings else {
        return Err(not("it has no transformer_block"));
    };
    Ok(Gpt2 {
        vocab,
        width,
        ffn,
        heads,
        length,
        activation,
        blocks: (2..norm).collect(),
        norm,
        head,
    })
}

/// A Starling map's GPT-2 module, by its field name in a block (`query`, `key` and `value`
/// are all `c_attn`).
fn module_of(field: &str) -> &'static str {
    match field {
        "query" | "key" | "value" => "attn.c_attn",
        "output" => "attn.c_proj",
        "ffn_inner" => "mlp.c_fc",
        _ => "mlp.c_proj",
    }
}

/// The merged model as a GPT-2 checkpoint (its head untied: Starling trains it apart).
pub(super) fn checkpoint(spec: &ModelSpec, values: &[f32]) -> Result<Files, HfExportError> {
    let g = shape(spec)?;
    let named = by_name(spec, values)?;
    let get = |name: &str| named.get(name).expect("the spec names it");
    let mut out = BTreeMap::new();
    let ours = |name: &str| {
        let (shape, v) = get(name);
        (shape.clone(), v.to_vec())
    };
    out.insert("transformer.wte.weight".into(), ours("layers.0.Embedding.weight"));
    out.insert("transformer.wpe.weight".into(), ours("layers.1.PositionEmbedding.weight"));
    let w = g.width as usize;
    for (k, b) in g.blocks.iter().enumerate() {
        let (block, theirs) =
            (format!("layers.{b}.TransformerBlock"), format!("transformer.h.{k}"));
        for (norm, ln) in [("norm_attention", "ln_1"), ("norm_ffn", "ln_2")] {
            out.insert(format!("{theirs}.{ln}.weight"), ours(&format!("{block}.{norm}.gamma")));
            out.insert(format!("{theirs}.{ln}.bias"), ours(&format!("{block}.{norm}.beta")));
        }
        for field in ["output", "ffn_inner", "ffn_outer"] {
            let module = module_of(field);
            out.insert(
                format!("{theirs}.{module}.weight"),
                ours(&format!("{block}.{field}.weight")),
            );
            out.insert(format!("{theirs}.{module}.bias"), ours(&format!("{block}.{field}.bias")));
        }
        // c_attn is `[width, 3·width]`: each row the query's, key's and value's side by side.
        let part = |field: &str, what: &str| get(&format!("{block}.{field}.{what}")).1;
        let (q, k_, v) = (part("query", "weight"), part("key", "weight"), part("value", "weight"));
        let mut fused = Vec::with_capacity(3 * w * w);
        for row in 0..w {
            for m in [q, k_, v] {
                fused.extend_from_slice(&m[row * w..(row + 1) * w]);
            }
        }
        out.insert(format!("{theirs}.attn.c_attn.weight"), (vec![g.width, 3 * g.width], fused));
        let bias: Vec<f32> =
            ["query", "key", "value"].iter().flat_map(|f| part(f, "bias").to_vec()).collect();
        out.insert(format!("{theirs}.attn.c_attn.bias"), (vec![3 * g.width], bias));
    }
    out.insert(
        "transformer.ln_f.weight".into(),
        ours(&format!("layers.{}.LayerNorm.gamma", g.norm)),
    );
    out.insert("transformer.ln_f.bias".into(), ours(&format!("layers.{}.LayerNorm.beta", g.norm)));
    if get(&format!("layers.{}.Linear.bias", g.head)).1.iter().any(|v| *v != 0.0) {
        return Err(HfExportError::Unrepresentable(
            "the head's bias is not zero: GPT-2's lm_head has none".into(),
        ));
    }
    let head = get(&format!("layers.{}.Linear.weight", g.head)).1;
    out.insert(
        "lm_head.weight".into(),
        (vec![g.vocab, g.width], transpose(head, g.width, g.vocab)),
    );
    let activation = match g.activation {
        FfnActivation::GeluTanh => "gelu_new",
        FfnActivation::Gelu => "gelu",
    };
    let config = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": g.vocab,
        "n_positions": g.length,
        "n_embd": g.width,
        "n_layer": g.blocks.len(),
        "n_head": g.heads,
        "n_inner": g.ffn,
        "activation_function": activation,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": false,
        "torch_dtype": "float32",
    });
    Ok(BTreeMap::from([
        ("config.json", serde_json::to_vec_pretty(&config).expect("JSON")),
        ("model.safetensors", safetensors_file(out)),
    ]))
}

/// A LoRA run's adapters as PEFT's for GPT-2. A block's query, key and value adapters (rank
/// `r` each, `m` of them) become one adapter of `c_attn` of rank `m·r`: `A` their `A`s side by
/// side, `B` each `B` in its own rows and its map's third of the columns, zero elsewhere, and
/// `alpha` `m·alpha` so that the scale stays `alpha / r` (`rank_pattern`, `alpha_pattern`).
pub(super) fn peft_adapters(
    spec: &ModelSpec,
    lora: &LoraSpec,
    values: &[f32],
) -> Result<Files, HfExportError> {
    let g = shape(&spec.without_lora())?;
    let named = by_name(spec, values)?;
    let (r, w) = (lora.rank, g.width);
    let mut adapters = PeftAdapters::new(lora);
    let adapter = |path: &str| {
        spec.lora_rank(path)?;
        Some((named[&format!("{path}.lora_a")].1, named[&format!("{path}.lora_b")].1))
    };
    for (k, b) in g.blocks.iter().enumerate() {
        let (ours, theirs) = (format!("layers.{b}.TransformerBlock"), format!("transformer.h.{k}"));
        // The fused attention adapter: (its third of c_attn's columns, A, B) per adapted map.
        let fused: Vec<(usize, &[f32], &[f32])> = ["query", "key", "value"]
            .iter()
            .enumerate()
            .filter_map(|(third, f)| adapter(&format!("{ours}.{f}")).map(|(a, b)| (third, a, b)))
            .collect();
        if !fused.is_empty() {
            let (m, ru, wu) = (fused.len() as u64, r as usize, w as usize);
            let mut a = Vec::with_capacity((w * m * r) as usize);
            for row in 0..wu {
                for (_, a_j, _) in &fused {
                    a.extend_from_slice(&a_j[row * ru..(row + 1) * ru]);
                }
            }
            let mut b = vec![0f32; (m * r * 3 * w) as usize];
            for (j, (third, _, b_j)) in fused.iter().enumerate() {
                for row in 0..ru {
                    let at = (j * ru + row) * 3 * wu + third * wu;
                    b[at..at + wu].copy_from_slice(&b_j[row * wu..(row + 1) * wu]);
                }
            }
            adapters.add(format!("{theirs}.attn.c_attn"), &a, &b, [w, m * r, 3 * w]);
        }
        for (field, fan_in, fan_out) in
            [("output", w, w), ("ffn_inner", w, g.ffn), ("ffn_outer", g.ffn, w)]
        {
            if let Some((a, b)) = adapter(&format!("{ours}.{field}")) {
                adapters.add(format!("{theirs}.{}", module_of(field)), a, b, [fan_in, r, fan_out]);
            }
        }
    }
    if let Some((a, b)) = adapter(&format!("layers.{}.Linear", g.head)) {
        adapters.add("lm_head".into(), a, b, [w, r, g.vocab]);
    }
    Ok(adapters.files(true))
}
