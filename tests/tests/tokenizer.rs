//! Tokenizer and chat template against the Python references in tests/fixtures/tokenizer/
//! (tools/fixtures/tokenizer_fixture.py: tokenizers for ids, jinja2 set up like transformers'
//! apply_chat_template for the rendered prompts).

use std::fmt;
use std::path::{Path, PathBuf};

use nextn_engine::text::chat_template::{ChatTemplateError, TemplateOrigin};
use nextn_engine::text::tokenizer::{GenerationConfig, Tokenizer, TokenizerBundle, TokenizerError};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixture_dir("tokenizer").join("reference.json"))
        .expect("reference.json");
    serde_json::from_str(&text).expect("reference.json parses")
}

/// The reference again, with object keys in file order: `tojson` output depends on key order,
/// and serde_json::Value sorts keys unless serde_json is built with `preserve_order`.
fn ordered_reference() -> Ordered {
    let text = std::fs::read_to_string(fixture_dir("tokenizer").join("reference.json"))
        .expect("reference.json");
    serde_json::from_str(&text).expect("reference.json parses")
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("ids array")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "nextn-tokenizer-test-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

fn bundle() -> TokenizerBundle {
    TokenizerBundle::load(fixture_dir("tokenizer")).expect("fixture bundle loads")
}

fn extra_of(case: &Value) -> serde_json::Map<String, Value> {
    case["kwargs"].as_object().cloned().unwrap_or_default()
}

#[test]
fn encode_cases_match_python_ids_and_decodes() {
    let reference = reference();
    let bundle = bundle();
    let tokenizer = bundle.require_tokenizer().unwrap();
    assert_eq!(
        tokenizer.vocab_size() as u64,
        reference["vocab_size"].as_u64().unwrap()
    );
    let cases = reference["encode"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let expected = ids(&case["ids"]);
        assert_eq!(
            tokenizer.encode(text, false).unwrap(),
            expected,
            "encode {name}"
        );
        assert_eq!(
            tokenizer.encode(text, true).unwrap(),
            expected,
            "encode {name} (no BOS is added)"
        );
        assert_eq!(
            tokenizer.decode(&expected, false).unwrap(),
            case["decoded"].as_str().unwrap(),
            "decode {name}"
        );
        assert_eq!(
            tokenizer.decode(&expected, true).unwrap(),
            case["decoded_skip_special"].as_str().unwrap(),
            "decode {name} skipping special tokens"
        );
    }
}

#[test]
fn added_tokens_have_the_reference_ids() {
    let reference = reference();
    let bundle = bundle();
    let tokenizer = bundle.require_tokenizer().unwrap();
    for (token, id) in reference["added_tokens"].as_object().unwrap() {
        let id = id.as_u64().unwrap() as u32;
        assert_eq!(tokenizer.token_to_id(token), Some(id), "{token}");
        assert_eq!(tokenizer.id_to_token(id).as_deref(), Some(token.as_str()));
    }
    assert_eq!(tokenizer.token_to_id("<|no_such_token|>"), None);
}

#[test]
fn chat_cases_render_byte_identical_to_jinja2() {
    let reference = reference();
    let ordered = ordered_reference();
    let bundle = bundle();
    let template = bundle
        .chat_template()
        .expect("chat_template.jinja is found");
    assert!(
        matches!(template.origin(), TemplateOrigin::File(path) if path.ends_with("chat_template.jinja"))
    );
    let cases = reference["chat"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for (i, case) in cases.iter().enumerate() {
        let name = case["name"].as_str().unwrap();
        let ordered_case = ordered.get("chat").index(i);
        let messages = ordered_case.get("messages").as_array();
        let tools = ordered_case.get("tools").as_opt_array();
        let add_generation_prompt = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = template
            .render(messages, tools, add_generation_prompt, &extra_of(case))
            .unwrap();
        let expected = case["text"].as_str().unwrap();
        assert!(
            rendered == expected,
            "chat case {name} differs from jinja2\n--- rust\n{rendered}\n--- jinja2\n{expected}\n---"
        );
        let prompt_ids = bundle
            .encode_chat(messages, tools, add_generation_prompt, &extra_of(case))
            .unwrap();
        assert_eq!(prompt_ids, ids(&case["ids"]), "prompt ids of {name}");
    }
}

#[test]
fn raise_exception_cases_give_the_typed_error_and_message() {
    let reference = reference();
    let ordered = ordered_reference();
    let bundle = bundle();
    let template = bundle.chat_template().unwrap();
    for (i, case) in reference["errors"].as_array().unwrap().iter().enumerate() {
        let ordered_case = ordered.get("errors").index(i);
        let err = template
            .render(
                ordered_case.get("messages").as_array(),
                ordered_case.get("tools").as_opt_array(),
                case["add_generation_prompt"].as_bool().unwrap(),
                &extra_of(case),
            )
            .unwrap_err();
        match err {
            ChatTemplateError::Raised { message } => {
                assert_eq!(message, case["message"].as_str().unwrap())
            }
            other => panic!(
                "case {}: expected ChatTemplateError::Raised, got {other}",
                case["name"]
            ),
        }
    }
}

#[test]
fn template_from_tokenizer_config_field_renders_the_same() {
    let reference = reference();
    let ordered = ordered_reference();
    let bundle = TokenizerBundle::load(fixture_dir("tokenizer_config_template")).unwrap();
    let template = bundle
        .chat_template()
        .expect("template from tokenizer_config.json");
    assert!(
        matches!(template.origin(), TemplateOrigin::TokenizerConfig(_)),
        "{:?}",
        template.origin()
    );
    assert_eq!(
        template.special_tokens().eos_token.as_deref(),
        Some("<|im_end|>")
    );
    assert_eq!(template.special_tokens().bos_token, None);
    for (i, case) in reference["chat"].as_array().unwrap().iter().enumerate() {
        let ordered_case = ordered.get("chat").index(i);
        let rendered = template
            .render(
                ordered_case.get("messages").as_array(),
                ordered_case.get("tools").as_opt_array(),
                case["add_generation_prompt"].as_bool().unwrap(),
                &extra_of(case),
            )
            .unwrap();
        assert_eq!(rendered, case["text"].as_str().unwrap(), "{}", case["name"]);
    }
    // No generation_config.json or config.json there: the stop id comes from eos_token alone.
    let im_end = reference["added_tokens"]["<|im_end|>"].as_u64().unwrap() as u32;
    assert_eq!(bundle.eos_token_ids(), &[im_end]);
    assert!(bundle.generation_config().is_none());
}

#[test]
fn eos_ids_come_from_generation_config_list() {
    let reference = reference();
    let bundle = bundle();
    let expected = ids(&reference["eos_token_ids"]);
    assert_eq!(bundle.eos_token_ids(), expected.as_slice());
    let generation = bundle.generation_config().unwrap();
    assert_eq!(generation.eos_token_id, expected);
    assert_eq!(generation.top_k, Some(20));
    assert_eq!(generation.top_p, Some(0.95));
    assert_eq!(generation.temperature, Some(0.6));
    assert_eq!(generation.min_p, None);
    assert!(expected.iter().all(|&id| bundle.is_eos(id)));
}

#[test]
fn eos_ids_are_the_union_of_every_source_in_order() {
    let reference = reference();
    let tokens = &reference["added_tokens"];
    let id = |t: &str| tokens[t].as_u64().unwrap() as u32;
    let dir = scratch_dir("eos-union");
    std::fs::copy(
        fixture_dir("tokenizer").join("tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        format!(r#"{{"eos_token_id": {}}}"#, id("<|im_end|>")),
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        format!(
            r#"{{"model_type": "qwen3_5_moe", "eos_token_id": null, "text_config": {{"eos_token_id": [{}, {}]}}}}"#,
            id("<|endoftext|>"),
            id("<|im_end|>")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": {"content": "<|im_start|>", "special": true}}"#,
    )
    .unwrap();
    let bundle = TokenizerBundle::load(&dir).unwrap();
    assert_eq!(
        bundle.eos_token_ids(),
        &[id("<|im_end|>"), id("<|endoftext|>"), id("<|im_start|>")]
    );
    assert!(bundle.chat_template().is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dir_without_tokenizer_files_loads_with_nothing() {
    let dir = scratch_dir("empty");
    let bundle = TokenizerBundle::load(&dir).unwrap();
    assert!(bundle.tokenizer().is_none());
    assert!(bundle.chat_template().is_none());
    assert!(bundle.generation_config().is_none());
    assert!(bundle.eos_token_ids().is_empty());
    assert!(matches!(
        bundle.require_tokenizer(),
        Err(TokenizerError::MissingTokenizer { .. })
    ));

    // Only a config.json (ids in, ids out): its eos id is still honoured.
    std::fs::write(
        dir.join("config.json"),
        r#"{"text_config": {"eos_token_id": 5}}"#,
    )
    .unwrap();
    let bundle = TokenizerBundle::load(&dir).unwrap();
    assert!(bundle.tokenizer().is_none());
    assert_eq!(bundle.eos_token_ids(), &[5]);
    let _ = std::fs::remove_dir_all(&dir);

    let missing = TokenizerBundle::load(dir.join("does-not-exist")).unwrap_err();
    assert!(
        matches!(missing, TokenizerError::NotADirectory(_)),
        "{missing}"
    );
}

fn assert_names_file(err: &dyn fmt::Display, file: &str) {
    let message = err.to_string();
    assert!(
        message.contains(file),
        "error should name {file}: {message}"
    );
}

#[test]
fn malformed_files_give_errors_naming_the_file() {
    let dir = scratch_dir("malformed");
    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    let err = TokenizerBundle::load(&dir).unwrap_err();
    assert!(matches!(err, TokenizerError::Load { .. }), "{err:?}");
    assert_names_file(&err, "tokenizer.json");
    let err = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap_err();
    assert_names_file(&err, "tokenizer.json");
    std::fs::write(
        dir.join("tokenizer.json"),
        r#"{"model": {"type": "BPE", "vocab": 3}}"#,
    )
    .unwrap();
    assert_names_file(&TokenizerBundle::load(&dir).unwrap_err(), "tokenizer.json");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();

    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": "im_end"}"#,
    )
    .unwrap();
    let err = TokenizerBundle::load(&dir).unwrap_err();
    assert!(matches!(err, TokenizerError::Json { .. }), "{err:?}");
    assert_names_file(&err, "generation_config.json");
    assert_names_file(
        &GenerationConfig::from_file(dir.join("generation_config.json")).unwrap_err(),
        "generation_config.json",
    );
    std::fs::remove_file(dir.join("generation_config.json")).unwrap();

    std::fs::write(dir.join("config.json"), r#"{"eos_token_id": "x"}"#).unwrap();
    assert_names_file(&TokenizerBundle::load(&dir).unwrap_err(), "config.json");
    std::fs::remove_file(dir.join("config.json")).unwrap();

    std::fs::write(dir.join("tokenizer_config.json"), "[1, 2").unwrap();
    assert_names_file(
        &TokenizerBundle::load(&dir).unwrap_err(),
        "tokenizer_config.json",
    );
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": "{% for %}"}"#,
    )
    .unwrap();
    let err = TokenizerBundle::load(&dir).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::ChatTemplate(ChatTemplateError::Syntax { .. })
        ),
        "{err:?}"
    );
    assert_names_file(&err, "tokenizer_config.json");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn streaming_decode_over_chinese_yields_the_full_string() {
    let bundle = bundle();
    let tokenizer = bundle.require_tokenizer().unwrap();
    for text in [
        "这款面霜今天直播间只要99元！库存还剩最后五十件。",
        "Hot deal 🔥 限时秒杀 👍🏽 ¥99 — 快下单",
    ] {
        let ids = tokenizer.encode(text, false).unwrap();
        let mut stream = tokenizer.decode_stream(false);
        let mut pieces = Vec::new();
        let mut held_back = 0;
        for &id in &ids {
            match stream.push(id).unwrap() {
                Some(piece) => {
                    assert!(
                        !piece.contains('\u{FFFD}'),
                        "piece {piece:?} carries a broken character"
                    );
                    pieces.push(piece);
                }
                None => held_back += 1,
            }
        }
        assert_eq!(stream.flush().unwrap(), None);
        assert_eq!(pieces.concat(), text);
        assert!(
            held_back > 0,
            "some characters span several tokens, so some pushes must wait"
        );
    }
}

#[test]
fn streaming_decode_flushes_an_incomplete_tail_and_skips_special_tokens() {
    let bundle = bundle();
    let tokenizer = bundle.require_tokenizer().unwrap();
    // 🔥 is not in the training corpus: four byte-level tokens.
    let mut ids = tokenizer.encode("<|im_start|>🔥", false).unwrap();
    assert_eq!(ids.len(), 5);
    let mut stream = tokenizer.decode_stream(true);
    // Drop its last byte: the stream must hold the rest back, then flush one U+FFFD.
    ids.pop();
    let mut out = String::new();
    for &id in &ids {
        if let Some(piece) = stream.push(id).unwrap() {
            out.push_str(&piece);
        }
    }
    assert_eq!(
        out, "",
        "the special token is skipped and the partial character is held back"
    );
    assert_eq!(stream.flush().unwrap().as_deref(), Some("\u{FFFD}"));
}

// ---------------------------------------------------------------------------------------------
// Order-preserving JSON for the test inputs.

#[derive(Debug, Clone)]
enum Ordered {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Arr(Vec<Ordered>),
    Obj(Vec<(String, Ordered)>),
}

impl Ordered {
    fn get(&self, key: &str) -> &Ordered {
        match self {
            Ordered::Obj(entries) => entries
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v)
                .unwrap_or(&Ordered::Null),
            _ => &Ordered::Null,
        }
    }

    fn index(&self, i: usize) -> &Ordered {
        match self {
            Ordered::Arr(items) => &items[i],
            other => panic!("not an array: {other:?}"),
        }
    }

    fn as_array(&self) -> &[Ordered] {
        self.as_opt_array().expect("an array")
    }

    fn as_opt_array(&self) -> Option<&[Ordered]> {
        match self {
            Ordered::Arr(items) => Some(items),
            _ => None,
        }
    }
}

impl Serialize for Ordered {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Ordered::Null => serializer.serialize_unit(),
            Ordered::Bool(b) => serializer.serialize_bool(*b),
            Ordered::Int(i) => serializer.serialize_i64(*i),
            Ordered::UInt(u) => serializer.serialize_u64(*u),
            Ordered::Float(f) => serializer.serialize_f64(*f),
            Ordered::Str(s) => serializer.serialize_str(s),
            Ordered::Arr(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Ordered::Obj(entries) => {
                let mut map = serializer.serialize_map(Some(entries.len()))?;
                for (key, value) in entries {
                    map.serialize_entry(key, value)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OrderedVisitor;
        impl<'de> Visitor<'de> for OrderedVisitor {
            type Value = Ordered;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("JSON")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Ordered, E> {
                Ok(Ordered::Null)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Ordered, E> {
                Ok(Ordered::Bool(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Ordered, E> {
                Ok(Ordered::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Ordered, E> {
                Ok(Ordered::UInt(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Ordered, E> {
                Ok(Ordered::Float(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Ordered, E> {
                Ok(Ordered::Str(v.to_owned()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Ordered, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Ordered::Arr(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Ordered, A::Error> {
                let mut entries = Vec::new();
                while let Some((key, value)) = map.next_entry()? {
                    entries.push((key, value));
                }
                Ok(Ordered::Obj(entries))
            }
        }
        deserializer.deserialize_any(OrderedVisitor)
    }
}
