//! Bad checkpoints and configs give typed errors that name the tensor, file or field — never a panic.

use std::collections::HashMap;
use std::path::Path;

use nextn_engine::{LoadError, LoadOptions, Model, TensorProblem};
use nextn_tests::TempDir;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn load(dir: &Path) -> Result<Model, LoadError> {
    Model::load(dir, &LoadOptions::default())
}

/// Rewrite `file` in `dir`, letting `edit` change the (name → (dtype, shape, bytes)) table.
fn rewrite(dir: &Path, file: &str, edit: impl FnOnce(&mut HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>)) {
    let path = dir.join(file);
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut table: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
        .collect();
    edit(&mut table);
    let views: Vec<(String, TensorView)> = table
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn problems(err: LoadError) -> Vec<TensorProblem> {
    match err {
        LoadError::Tensors { problems, .. } => problems,
        other => panic!("expected a tensor report, got: {other}"),
    }
}

const EMBED: &str = "model.embed_tokens.weight";
const Q_PROJ: &str = "model.layers.0.self_attn.q_proj.weight";

#[test]
fn missing_tensor_is_named_with_its_expected_shape() {
    let dir = TempDir::copy_of("qwen3_moe");
    rewrite(dir.path(), "model.safetensors", |t| {
        t.remove(Q_PROJ);
    });
    let err = load(dir.path()).err().expect("must fail");
    let msg = err.to_string();
    assert!(msg.contains(Q_PROJ) && msg.contains("missing"), "{msg}");
    assert_eq!(problems(err), vec![TensorProblem::Missing { name: Q_PROJ.into(), expected: vec![128, 64] }]);
}

#[test]
fn wrong_shape_reports_expected_and_found() {
    let dir = TempDir::copy_of("qwen3_moe");
    rewrite(dir.path(), "model.safetensors", |t| {
        let e = t.get_mut(Q_PROJ).unwrap();
        e.1 = vec![64, 128];
    });
    let p = problems(load(dir.path()).err().expect("must fail"));
    assert_eq!(p, vec![TensorProblem::Shape { name: Q_PROJ.into(), expected: vec![128, 64], found: vec![64, 128] }]);
}

#[test]
fn unsupported_dtype_is_named() {
    let dir = TempDir::copy_of("qwen3_moe");
    rewrite(dir.path(), "model.safetensors", |t| {
        let e = t.get_mut(Q_PROJ).unwrap();
        e.0 = Dtype::I32; // same byte size as F32
    });
    let err = load(dir.path()).err().expect("must fail");
    assert!(err.to_string().contains(Q_PROJ), "{err}");
    assert_eq!(problems(err), vec![TensorProblem::Dtype { name: Q_PROJ.into(), found: "I32".into() }]);
}

#[test]
fn all_problems_come_in_one_report() {
    let dir = TempDir::copy_of("qwen3_moe");
    rewrite(dir.path(), "model.safetensors", |t| {
        t.remove(Q_PROJ);
        t.get_mut(EMBED).unwrap().1 = vec![128, 128];
        t.insert("model.layers.0.extra.weight".into(), (Dtype::F32, vec![2], vec![0; 8]));
    });
    let p = problems(load(dir.path()).err().expect("must fail"));
    assert_eq!(p.len(), 3, "{p:?}");
    assert!(p.iter().any(|x| matches!(x, TensorProblem::Missing { name, .. } if name == Q_PROJ)));
    assert!(p.iter().any(|x| matches!(x, TensorProblem::Shape { name, .. } if name == EMBED)));
    assert!(p.iter().any(|x| matches!(x, TensorProblem::Unexpected { name, .. } if name == "model.layers.0.extra.weight")));
}

#[test]
fn mtp_tensors_are_recognised_not_unexpected() {
    // The released-layout fixture carries mtp.* tensors; it loads cleanly.
    load(&nextn_tests::fixture("qwen3_5_moe")).expect("mtp.* must not be reported");
    assert!(std::fs::read_to_string(nextn_tests::fixture("qwen3_5_moe").join("model.safetensors.index.json"))
        .unwrap()
        .contains("\"mtp.fc.weight\""));
}

#[test]
fn truncated_safetensors_names_the_file() {
    let dir = TempDir::copy_of("qwen3_moe");
    let path = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 100).unwrap();
    let err = load(dir.path()).err().expect("must fail");
    assert!(matches!(err, LoadError::Safetensors { .. }), "{err}");
    assert!(err.to_string().contains("model.safetensors") && err.to_string().contains("truncated"), "{err}");
    // Truncated inside the header, too.
    f.set_len(20).unwrap();
    assert!(matches!(load(dir.path()).err().expect("must fail"), LoadError::Safetensors { .. }));
}

#[test]
fn malformed_or_unsupported_config_names_the_file_or_field() {
    let dir = TempDir::copy_of("qwen3_moe");
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, "{\"model_type\": \"qwen3_moe\", ").unwrap();
    let err = load(dir.path()).err().expect("must fail");
    assert!(matches!(err, LoadError::Json { .. }) && err.to_string().contains("config.json"), "{err}");

    std::fs::write(&cfg, r#"{"model_type": "mixtral"}"#).unwrap();
    let err = load(dir.path()).err().expect("must fail");
    assert!(err.to_string().contains("mixtral") && err.to_string().contains("qwen3_moe"), "{err}");

    let good = std::fs::read_to_string(nextn_tests::fixture("qwen3_moe").join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
    v["num_key_value_heads"] = serde_json::json!(3);
    std::fs::write(&cfg, v.to_string()).unwrap();
    let err = load(dir.path()).err().expect("must fail");
    assert!(err.to_string().contains("num_key_value_heads"), "{err}");

    std::fs::remove_file(&cfg).unwrap();
    let err = load(dir.path()).err().expect("must fail");
    assert!(matches!(err, LoadError::Io { .. }) && err.to_string().contains("config.json"), "{err}");
}

#[test]
fn sharded_index_naming_a_missing_shard_names_it() {
    let dir = TempDir::copy_of("qwen3_5_moe");
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let err = load(dir.path()).err().expect("must fail");
    let msg = err.to_string();
    assert!(matches!(err, LoadError::Shard { .. }), "{msg}");
    assert!(msg.contains("model-00002-of-00002.safetensors") && msg.contains("model.safetensors.index.json"), "{msg}");
}

#[test]
fn directory_without_weights_is_a_clear_error() {
    let dir = TempDir::new("noweights");
    std::fs::copy(nextn_tests::fixture("qwen3_moe").join("config.json"), dir.path().join("config.json")).unwrap();
    let err = load(dir.path()).err().expect("must fail");
    assert!(matches!(err, LoadError::NoWeights { .. }), "{err}");
}

#[test]
fn out_of_range_token_and_empty_input_are_typed_errors() {
    let model = load(&nextn_tests::fixture("qwen3_moe")).unwrap();
    let vocab = model.config().vocab_size as u32;
    assert!(matches!(model.logits(&[1, vocab]), Err(nextn_engine::ForwardError::TokenOutOfRange { index: 1, .. })));
    assert!(matches!(model.logits(&[]), Err(nextn_engine::ForwardError::Empty)));
}

/// Backend failures are typed: a caller tells "no MTP head", "out of range" and "unsupported" apart by kind.
#[test]
fn backend_errors_are_typed_by_kind() {
    use nextn_engine::backend::select::make_backend;
    use nextn_engine::sched::step::StepCtx;
    use nextn_engine::{BackendError, CacheGeometry, Device, ModelSource};

    let dir = nextn_tests::fixture("qwen3_moe");
    let geo = CacheGeometry { num_blocks: 4, block_size: 16, num_slots: 2, lanes: 0 };
    let mut b = make_backend(Device::Cpu, ModelSource::open(&dir).unwrap(), geo).unwrap();
    let h = b.config().hidden_size;
    let mut ctx = StepCtx { block_size: 16, ..Default::default() };
    ctx.push_seq(&[1], 0, &[0], 0, |_| true);
    assert_eq!(b.mtp_forward(&ctx, &vec![0.0; h]), Err(BackendError::NoMtpHead { backend: "cpu" }));
    assert!(matches!(b.copy_state(0, 5), Err(BackendError::OutOfRange { backend: "cpu", .. })));
    if !cfg!(feature = "cuda") {
        let r = make_backend(Device::Cuda(0), ModelSource::open(&dir).unwrap(), geo);
        assert!(matches!(r.err(), Some(BackendError::Unsupported { backend: "cuda", .. })));
    }
}
