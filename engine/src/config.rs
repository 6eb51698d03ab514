//! `config.json` → [`ModelConfig`]: one typed, checked description of the model.
//!
//! Accepts the released Qwen3.5/3.6 VL wrapper (`qwen3_5_moe`, fields under `text_config`, `vision_config`
//! ignored), the flat text config (`qwen3_5_moe_text`), and Qwen3-MoE (`qwen3_moe`). Field names and defaults
//! follow HF transformers' config classes; everything the forward relies on is checked here, once, with an
//! error that names the field.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::LoadError;

/// The model families this engine implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Qwen3.5 / Qwen3.6 MoE: Gated DeltaNet + gated full attention, routed + shared experts, MTP.
    Qwen3_5Moe,
    /// Qwen3-MoE (e.g. Qwen3-30B-A3B): plain GQA attention, routed experts, optional dense layers.
    Qwen3Moe,
}

pub const SUPPORTED_MODEL_TYPES: [&str; 3] = ["qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe"];

/// Token mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    LinearAttention,
    FullAttention,
}

/// Gated DeltaNet dimensions (qwen3_5_moe only).
#[derive(Debug, Clone, PartialEq)]
pub struct LinearAttentionConfig {
    pub num_key_heads: usize,
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel_dim: usize,
}

impl LinearAttentionConfig {
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }
    /// Channels that go through the causal conv: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// Weight element counts, see [`ModelConfig::param_counts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamCounts {
    pub total: usize,
    pub active_per_token: usize,
}

/// The typed model configuration. Derived values are methods.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Gated attention: q_proj is twice as wide and carries a per-head sigmoid output gate.
    pub attn_output_gate: bool,
    pub layer_types: Vec<LayerType>,
    pub linear_attention: Option<LinearAttentionConfig>,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Width of the sigmoid-gated shared expert; 0 = none.
    pub shared_expert_intermediate_size: usize,
    /// Width of the dense MLP of non-sparse layers (qwen3_moe).
    pub intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    pub mtp_num_hidden_layers: usize,
    /// EOS ids named in config.json itself (generation_config.json may add more).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Number of rotated dims at the start of each q/k head.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Whether layer `i` uses the sparse MoE block (else a dense SwiGLU MLP).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        match self.architecture {
            Architecture::Qwen3_5Moe => true,
            Architecture::Qwen3Moe => {
                !self.mlp_only_layers.contains(&i)
                    && self.num_experts > 0
                    && (i + 1) % self.decoder_sparse_step == 0
            }
        }
    }

    /// Zero-centred RMSNorm (`x̂ * (1 + w)`) for the decoder norms, else plain (`x̂ * w`).
    pub fn zero_centred_norms(&self) -> bool {
        self.architecture == Architecture::Qwen3_5Moe
    }

    pub fn q_proj_out(&self) -> usize {
        let q = self.num_attention_heads * self.head_dim;
        if self.attn_output_gate { 2 * q } else { q }
    }

    /// Parameters (elements) of the main model: in total, and read per decoded token (top-k + shared
    /// experts, every dense matrix, one embedding row, the whole LM head).
    pub fn param_counts(&self) -> ParamCounts {
        let (h, d) = (self.hidden_size, self.head_dim);
        let (nh, nkv) = (self.num_attention_heads, self.num_key_value_heads);
        let (mut total, mut active) = (0usize, 0usize);
        for i in 0..self.num_hidden_layers {
            let mixer = match self.layer_types[i] {
                LayerType::FullAttention => self.q_proj_out() * h + 2 * nkv * d * h + nh * d * h + 2 * d,
                LayerType::LinearAttention => {
                    let la = self.linear_attention.as_ref().expect("checked");
                    let hv = la.num_value_heads;
                    la.conv_dim() * h + la.value_dim() * h + 2 * hv * h + la.conv_dim() * la.conv_kernel_dim
                        + 2 * hv + la.value_head_dim + h * la.value_dim()
                }
            };
            let norms = 2 * h;
            let (ff_total, ff_active) = if self.is_moe_layer(i) {
                let expert = 3 * self.moe_intermediate_size * h;
                let shared = if self.shared_expert_intermediate_size > 0 { 3 * self.shared_expert_intermediate_size * h + h } else { 0 };
                let router = self.num_experts * h;
                (router + self.num_experts * expert + shared, router + self.num_experts_per_tok * expert + shared)
            } else {
                (3 * self.intermediate_size * h, 3 * self.intermediate_size * h)
            };
            total += mixer + norms + ff_total;
            active += mixer + norms + ff_active;
        }
        let embed = self.vocab_size * h;
        let lm_head = if self.tie_word_embeddings { 0 } else { self.vocab_size * h };
        total += embed + lm_head + h;
        active += h + self.vocab_size * h + h;
        ParamCounts { total, active_per_token: active }
    }

    /// Read `<dir>/config.json` (or a path to a config file).
    pub fn from_path(path: &Path) -> Result<Self, LoadError> {
        if !path.exists() {
            return Err(LoadError::NotFound { path: path.to_path_buf() });
        }
        let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
        let text = std::fs::read_to_string(&file).map_err(|error| LoadError::Io { path: file.clone(), error })?;
        let value: Value =
            serde_json::from_str(&text).map_err(|error| LoadError::Json { path: file.clone(), error })?;
        Self::from_json(&value, &file)
    }

    /// Parse an already-read config.json. `path` is only used in error messages.
    pub fn from_json(value: &Value, path: &Path) -> Result<Self, LoadError> {
        let field_err = |field: &str, reason: String| LoadError::ConfigField {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason,
        };
        let Some(top) = value.as_object() else {
            return Err(field_err("<root>", "expected a JSON object".into()));
        };
        let model_type = match top.get("model_type") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => return Err(field_err("model_type", format!("expected a string, found {other}"))),
            None => return Err(field_err("model_type", "missing; cannot tell which architecture this is".into())),
        };
        // The VL wrapper keeps the language model under `text_config`; flatten it once, here.
        let (architecture, text, prefix) = match model_type.as_str() {
            "qwen3_5_moe" => {
                let text = top
                    .get("text_config")
                    .ok_or_else(|| field_err("text_config", "missing (required for model_type qwen3_5_moe)".into()))?;
                let mut text = text.clone();
                let Some(obj) = text.as_object_mut() else {
                    return Err(field_err("text_config", "expected a JSON object".into()));
                };
                // Wrapper-level fields that HF also honours for the text model when the nested one lacks them.
                for key in ["tie_word_embeddings", "eos_token_id"] {
                    if !obj.contains_key(key) {
                        if let Some(v) = top.get(key) {
                            obj.insert(key.to_string(), v.clone());
                        }
                    }
                }
                (Architecture::Qwen3_5Moe, text, "text_config.")
            }
            "qwen3_5_moe_text" => (Architecture::Qwen3_5Moe, value.clone(), ""),
            "qwen3_moe" => (Architecture::Qwen3Moe, value.clone(), ""),
            other => {
                return Err(LoadError::UnsupportedModelType {
                    path: path.to_path_buf(),
                    found: other.to_string(),
                    supported: SUPPORTED_MODEL_TYPES.to_vec(),
                });
            }
        };
        let ctx = Ctx { path, prefix };
        let Some(obj) = text.as_object() else {
            return Err(field_err(prefix.trim_end_matches('.'), "expected a JSON object".into()));
        };
        build(architecture, &Fields { obj, ctx: &ctx })
    }
}

/// Where a field came from, for error messages.
struct Ctx<'a> {
    path: &'a Path,
    prefix: &'a str,
}

impl Ctx<'_> {
    fn err(&self, field: &str, reason: impl Into<String>) -> LoadError {
        LoadError::ConfigField {
            path: PathBuf::from(self.path),
            field: format!("{}{field}", self.prefix),
            reason: reason.into(),
        }
    }
    fn required(&self, field: &str, v: Option<usize>) -> Result<usize, LoadError> {
        v.ok_or_else(|| self.err(field, "missing"))
    }
}

/// Typed access to the text-model fields, with errors that name the field. Unknown fields are ignored.
struct Fields<'a> {
    obj: &'a serde_json::Map<String, Value>,
    ctx: &'a Ctx<'a>,
}

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }
    fn usize(&self, name: &str) -> Result<Option<usize>, LoadError> {
        self.get(name)
            .map(|v| {
                v.as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .ok_or_else(|| self.ctx.err(name, format!("expected a non-negative integer, found {v}")))
            })
            .transpose()
    }
    fn f64(&self, name: &str) -> Result<Option<f64>, LoadError> {
        self.get(name)
            .map(|v| v.as_f64().ok_or_else(|| self.ctx.err(name, format!("expected a number, found {v}"))))
            .transpose()
    }
    fn bool(&self, name: &str) -> Result<Option<bool>, LoadError> {
        self.get(name)
            .map(|v| v.as_bool().ok_or_else(|| self.ctx.err(name, format!("expected true/false, found {v}"))))
            .transpose()
    }
    fn string(&self, name: &str) -> Result<Option<String>, LoadError> {
        self.get(name)
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| self.ctx.err(name, format!("expected a string, found {v}")))
            })
            .transpose()
    }
    fn list<T>(&self, name: &str, item: impl Fn(&Value) -> Option<T>) -> Result<Option<Vec<T>>, LoadError> {
        let Some(v) = self.get(name) else { return Ok(None) };
        let bad = || self.ctx.err(name, format!("expected a list, found {v}"));
        let items = v.as_array().ok_or_else(bad)?;
        items.iter().map(|x| item(x).ok_or_else(bad)).collect::<Result<Vec<_>, _>>().map(Some)
    }
}

fn build(architecture: Architecture, f: &Fields) -> Result<ModelConfig, LoadError> {
    let ctx = f.ctx;
    let is35 = architecture == Architecture::Qwen3_5Moe;
    let vocab_size = ctx.required("vocab_size", f.usize("vocab_size")?)?;
    let hidden_size = ctx.required("hidden_size", f.usize("hidden_size")?)?;
    let num_hidden_layers = ctx.required("num_hidden_layers", f.usize("num_hidden_layers")?)?;
    let num_attention_heads = ctx.required("num_attention_heads", f.usize("num_attention_heads")?)?;
    let num_key_value_heads = ctx.required("num_key_value_heads", f.usize("num_key_value_heads")?)?;
    for (field, v) in [
        ("vocab_size", vocab_size),
        ("hidden_size", hidden_size),
        ("num_hidden_layers", num_hidden_layers),
        ("num_attention_heads", num_attention_heads),
        ("num_key_value_heads", num_key_value_heads),
    ] {
        if v == 0 {
            return Err(ctx.err(field, "must be > 0"));
        }
    }
    // HF: qwen3_5_moe_text defaults head_dim to 256; qwen3_moe falls back to hidden / heads.
    let head_dim = match f.usize("head_dim")? {
        Some(d) => d,
        None if is35 => 256,
        None => hidden_size / num_attention_heads,
    };
    if head_dim == 0 {
        return Err(ctx.err("head_dim", "must be > 0"));
    }
    if num_attention_heads % num_key_value_heads != 0 {
        return Err(ctx.err(
            "num_key_value_heads",
            format!("{num_key_value_heads} does not divide num_attention_heads = {num_attention_heads}"),
        ));
    }

    // RoPE: theta and partial factor may sit at top level or inside `rope_parameters` (transformers 5).
    let rope_params = match f.get("rope_parameters") {
        None => None,
        Some(Value::Object(m)) => Some(m),
        Some(_) => return Err(ctx.err("rope_parameters", "expected a JSON object")),
    };
    let from_params = |key: &str| rope_params.and_then(|m| m.get(key)).and_then(Value::as_f64);
    if let Some(kind) = rope_params.and_then(|m| m.get("rope_type")).and_then(Value::as_str) {
        if kind != "default" {
            return Err(ctx.err("rope_parameters.rope_type", format!("`{kind}` is not supported (only `default`)")));
        }
    }
    if let Some(scaling) = f.get("rope_scaling") {
        let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str);
        if !scaling.is_null() && kind != Some("default") {
            return Err(ctx.err("rope_scaling", "rope scaling is not supported (only plain RoPE)"));
        }
    }
    let rope_theta = from_params("rope_theta")
        .or(f.f64("rope_theta")?)
        .ok_or_else(|| ctx.err("rope_theta", "missing (neither top level nor rope_parameters.rope_theta)"))?;
    if !(rope_theta > 0.0) {
        return Err(ctx.err("rope_theta", format!("must be > 0, found {rope_theta}")));
    }
    let partial_rotary_factor = from_params("partial_rotary_factor")
        .or(f.f64("partial_rotary_factor")?)
        .unwrap_or(if is35 { 0.25 } else { 1.0 });
    let rotary_dim = (head_dim as f64 * partial_rotary_factor) as usize;
    if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) || rotary_dim % 2 != 0 || rotary_dim == 0 {
        return Err(ctx.err(
            "partial_rotary_factor",
            format!("{partial_rotary_factor} × head_dim {head_dim} must give an even rotary dim in 2..=head_dim"),
        ));
    }

    if f.bool("attention_bias")? == Some(true) {
        return Err(ctx.err("attention_bias", "attention biases are not supported"));
    }
    if f.bool("use_sliding_window")? == Some(true) {
        return Err(ctx.err("use_sliding_window", "sliding-window attention is not supported"));
    }
    if let Some(act) = f.string("hidden_act")? {
        if act != "silu" {
            return Err(ctx.err("hidden_act", format!("`{act}` is not supported (only `silu`)")));
        }
    }

    // Layer types: explicit list, else the interval rule (layer i is full iff (i + 1) % interval == 0).
    let layer_types = if !is35 {
        vec![LayerType::FullAttention; num_hidden_layers]
    } else if let Some(list) = f.list("layer_types", |v| v.as_str().map(str::to_string))? {
        if list.len() != num_hidden_layers {
            return Err(ctx.err(
                "layer_types",
                format!("has {} entries but num_hidden_layers = {num_hidden_layers}", list.len()),
            ));
        }
        list.iter()
            .enumerate()
            .map(|(i, s)| match s.as_str() {
                "linear_attention" => Ok(LayerType::LinearAttention),
                "full_attention" => Ok(LayerType::FullAttention),
                other => Err(ctx.err(
                    &format!("layer_types[{i}]"),
                    format!("`{other}`; expected `linear_attention` or `full_attention`"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?
    } else {
        let interval = f.usize("full_attention_interval")?.unwrap_or(4);
        if interval == 0 {
            return Err(ctx.err("full_attention_interval", "must be > 0"));
        }
        (0..num_hidden_layers)
            .map(|i| if (i + 1) % interval == 0 { LayerType::FullAttention } else { LayerType::LinearAttention })
            .collect()
    };

    let linear_attention = if layer_types.contains(&LayerType::LinearAttention) {
        let la = LinearAttentionConfig {
            num_key_heads: ctx.required("linear_num_key_heads", f.usize("linear_num_key_heads")?)?,
            num_value_heads: ctx.required("linear_num_value_heads", f.usize("linear_num_value_heads")?)?,
            key_head_dim: ctx.required("linear_key_head_dim", f.usize("linear_key_head_dim")?)?,
            value_head_dim: ctx.required("linear_value_head_dim", f.usize("linear_value_head_dim")?)?,
            conv_kernel_dim: f.usize("linear_conv_kernel_dim")?.unwrap_or(4),
        };
        for (field, v) in [
            ("linear_num_key_heads", la.num_key_heads),
            ("linear_num_value_heads", la.num_value_heads),
            ("linear_key_head_dim", la.key_head_dim),
            ("linear_value_head_dim", la.value_head_dim),
            ("linear_conv_kernel_dim", la.conv_kernel_dim),
        ] {
            if v == 0 {
                return Err(ctx.err(field, "must be > 0"));
            }
        }
        if la.num_value_heads % la.num_key_heads != 0 {
            return Err(ctx.err(
                "linear_num_value_heads",
                format!("{} is not a multiple of linear_num_key_heads = {}", la.num_value_heads, la.num_key_heads),
            ));
        }
        Some(la)
    } else {
        None
    };

    // MoE. HF's Qwen3MoeConfig maps `num_experts` onto `num_local_experts`; accept either spelling.
    let num_experts = match (f.usize("num_experts")?, f.usize("num_local_experts")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(ctx.err("num_experts", format!("{a} disagrees with num_local_experts = {b}")));
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => return Err(ctx.err("num_experts", "missing (also looked for num_local_experts)")),
    };
    let num_experts_per_tok = ctx.required("num_experts_per_tok", f.usize("num_experts_per_tok")?)?;
    let moe_intermediate_size = ctx.required("moe_intermediate_size", f.usize("moe_intermediate_size")?)?;
    let decoder_sparse_step = f.usize("decoder_sparse_step")?.unwrap_or(1);
    let mlp_only_layers = if is35 { Vec::new() } else { f.list("mlp_only_layers", |v| v.as_u64().map(|x| x as usize))?.unwrap_or_default() };
    if decoder_sparse_step == 0 {
        return Err(ctx.err("decoder_sparse_step", "must be > 0"));
    }
    if let Some(&bad) = mlp_only_layers.iter().find(|&&i| i >= num_hidden_layers) {
        return Err(ctx.err("mlp_only_layers", format!("layer {bad} >= num_hidden_layers = {num_hidden_layers}")));
    }
    if num_experts > 0 && (num_experts_per_tok == 0 || num_experts_per_tok > num_experts) {
        return Err(ctx.err(
            "num_experts_per_tok",
            format!("{num_experts_per_tok} must be in 1..=num_experts ({num_experts})"),
        ));
    }
    let shared_expert_intermediate_size = if is35 {
        ctx.required("shared_expert_intermediate_size", f.usize("shared_expert_intermediate_size")?)?
    } else {
        0
    };

    let mut cfg = ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: f.f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        rope_theta,
        partial_rotary_factor,
        max_position_embeddings: f.usize("max_position_embeddings")?.unwrap_or(32768),
        tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(false),
        // Qwen3.5 attention is always gated in HF (q_proj is 2× wide); the flag is informative there.
        attn_output_gate: if is35 { f.bool("attn_output_gate")?.unwrap_or(true) } else { false },
        layer_types,
        linear_attention,
        num_experts,
        num_experts_per_tok,
        moe_intermediate_size,
        shared_expert_intermediate_size,
        intermediate_size: 0,
        // HF's Qwen3.5 router always renormalises the top-k weights.
        norm_topk_prob: if is35 { true } else { f.bool("norm_topk_prob")?.unwrap_or(false) },
        decoder_sparse_step,
        mlp_only_layers,
        mtp_num_hidden_layers: if is35 { f.usize("mtp_num_hidden_layers")?.unwrap_or(0) } else { 0 },
        eos_token_ids: parse_token_ids(f.get("eos_token_id")).map_err(|r| ctx.err("eos_token_id", r))?,
    };
    if is35 && !cfg.attn_output_gate {
        return Err(ctx.err("attn_output_gate", "qwen3_5_moe attention without the output gate is not supported"));
    }
    if (0..num_hidden_layers).any(|i| !cfg.is_moe_layer(i)) {
        cfg.intermediate_size = ctx.required("intermediate_size", f.usize("intermediate_size")?)?;
    }
    Ok(cfg)
}

/// `eos_token_id` may be absent, null, one id or a list of ids.
pub(crate) fn parse_token_ids(v: Option<&Value>) -> Result<Vec<u32>, String> {
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| format!("expected a token id (non-negative integer), found {v}"))
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn qwen35_text() -> Value {
        json!({
            "model_type": "qwen3_5_moe_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "eos_token_id": 7
        })
    }

    fn parse(v: &Value) -> Result<ModelConfig, LoadError> {
        ModelConfig::from_json(v, Path::new("config.json"))
    }

    #[test]
    fn interval_rule_marks_every_fourth_layer_full() {
        let cfg = parse(&qwen35_text()).unwrap();
        let full: Vec<usize> =
            (0..8).filter(|&i| cfg.layer_types[i] == LayerType::FullAttention).collect();
        assert_eq!(full, vec![3, 7]);
        assert_eq!(cfg.rotary_dim(), 8);
        assert_eq!(cfg.rope_theta, 1e7);
        assert!(cfg.norm_topk_prob);
        assert_eq!(cfg.eos_token_ids, vec![7]);
    }

    #[test]
    fn vl_wrapper_reads_text_config_and_ignores_vision() {
        let v = json!({"model_type": "qwen3_5_moe", "tie_word_embeddings": false,
                       "vision_config": {"depth": 27}, "text_config": qwen35_text()});
        let cfg = parse(&v).unwrap();
        assert_eq!(cfg.architecture, Architecture::Qwen3_5Moe);
        assert_eq!(cfg.hidden_size, 64);
    }

    #[test]
    fn wrapper_without_text_config_names_the_field() {
        let err = parse(&json!({"model_type": "qwen3_5_moe"})).unwrap_err();
        assert!(err.to_string().contains("text_config"), "{err}");
    }

    #[test]
    fn qwen3_moe_accepts_num_local_experts_and_sparse_step() {
        let v = json!({"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1e6, "num_local_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "intermediate_size": 48,
            "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": true, "eos_token_id": [1, 2]});
        let cfg = parse(&v).unwrap();
        assert_eq!(cfg.num_experts, 8);
        assert_eq!(cfg.head_dim, 16);
        assert_eq!(cfg.rotary_dim(), 16);
        let moe: Vec<bool> = (0..4).map(|i| cfg.is_moe_layer(i)).collect();
        assert_eq!(moe, vec![false, true, false, false]);
        assert_eq!(cfg.eos_token_ids, vec![1, 2]);
    }

    #[test]
    fn unknown_model_type_lists_supported_ones() {
        let err = parse(&json!({"model_type": "llama"})).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("llama") && msg.contains("qwen3_5_moe") && msg.contains("qwen3_moe"), "{msg}");
    }

    #[test]
    fn invariant_violations_name_the_field() {
        let cases: Vec<(&str, Value, &str)> = vec![
            ("num_key_value_heads", json!(3), "num_key_value_heads"),
            ("layer_types", json!(["full_attention"]), "layer_types"),
            ("num_experts_per_tok", json!(9), "num_experts_per_tok"),
            ("linear_num_value_heads", json!(3), "linear_num_value_heads"),
            ("hidden_size", json!(0), "hidden_size"),
            ("hidden_size", json!("big"), "hidden_size"),
            ("rope_parameters", json!({"rope_type": "yarn", "rope_theta": 1e6}), "rope_type"),
        ];
        for (field, value, needle) in cases {
            let mut v = qwen35_text();
            v[field] = value;
            let err = parse(&v).expect_err(field);
            assert!(err.to_string().contains(needle), "{field}: {err}");
        }
        let mut v = qwen35_text();
        v.as_object_mut().unwrap().remove("vocab_size");
        assert!(parse(&v).unwrap_err().to_string().contains("vocab_size"));
    }
}
