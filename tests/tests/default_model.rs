//! The bundled default model (models/nextn-live-tiny): the engine reproduces transformers' greedy replies,
//! the chat template renders the same prompt ids, and MTP speculation changes nothing in greedy output.

use std::path::PathBuf;

use nextn_engine::spec::SpecConfig;
use nextn_engine::text::tokenizer::TokenizerBundle;
use nextn_engine::{Engine, EngineConfig, LoadOptions, Model, SamplingParams};

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/nextn-live-tiny")
}

#[derive(serde::Deserialize)]
struct Reference {
    max_new_tokens: usize,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    messages: Vec<serde_json::Value>,
    #[serde(default)]
    tools: Option<Vec<serde_json::Value>>,
    input_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
}

fn reference() -> Reference {
    serde_json::from_str(&std::fs::read_to_string(model_dir().join("reference.json")).unwrap()).unwrap()
}

fn engine(spec: Option<SpecConfig>) -> (Engine, TokenizerBundle) {
    let dir = model_dir();
    let model = Model::load(&dir, &LoadOptions::default()).unwrap();
    let bundle = TokenizerBundle::load(&dir).unwrap();
    let eos = bundle.eos_token_ids().to_vec();
    let tok = bundle.tokenizer().cloned();
    (Engine::new(model, tok, eos, EngineConfig { spec, ..Default::default() }).unwrap(), bundle)
}

#[test]
fn chat_template_renders_the_reference_prompt_ids() {
    let (_, bundle) = engine(None);
    let mut extra = serde_json::Map::new();
    extra.insert("enable_thinking".into(), serde_json::json!(false));
    for case in reference().cases {
        let ids = bundle.encode_chat(&case.messages, case.tools.as_deref(), true, &extra).unwrap();
        assert_eq!(ids, case.input_ids, "{}", case.name);
    }
}

#[test]
fn greedy_matches_transformers_and_mtp_changes_nothing() {
    let r = reference();
    let (mut plain, _) = engine(None);
    let (mut spec, _) = engine(Some(SpecConfig { draft_steps: 3 }));
    let mut accepted = 0;
    for case in &r.cases {
        let params = SamplingParams { max_new_tokens: r.max_new_tokens, ..SamplingParams::greedy() };
        let a = plain.generate(case.input_ids.clone(), params.clone(), |_| {}).unwrap();
        assert_eq!(a.token_ids, case.greedy_ids, "{}: engine vs transformers", case.name);
        let b = spec.generate(case.input_ids.clone(), params, |_| {}).unwrap();
        assert_eq!(b.token_ids, a.token_ids, "{}: MTP on vs off", case.name);
        accepted += b.spec.unwrap().accepted;
    }
    assert!(accepted > 0, "the trained MTP head's drafts are accepted on its own domain");
}
