//! Tool-call parsing: both Qwen formats, reasoning, coercion by schema, malformed calls, and a fuzz loop.

use std::collections::HashMap;

use nextn_agent::toolcall::{
    parse_reply, render_assistant_reply, render_assistant_tool_calls, NoSchemas, ParsedReply, ToolCall,
    ToolCallErrorKind,
};
use serde_json::{json, Map, Value};

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {
            "name": "get_price",
            "description": "Price of a product",
            "parameters": {"type": "object", "properties": {
                "sku": {"type": "string"},
                "qty": {"type": "integer"},
                "discount": {"type": "number"},
                "member": {"type": "boolean"},
                "coupon": {"type": "null"},
                "filters": {"type": "object"},
                "colors": {"type": "array", "items": {"type": "string"}},
                "limit": {"type": ["integer", "null"]},
                "code": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                "level": {"enum": [1, 2, 3]},
            }, "required": ["sku"]},
        }}),
        json!({"type": "function", "function": {
            "name": "say",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        }}),
    ]
}

fn parse(s: &str) -> ParsedReply {
    parse_reply(s, &tools())
}

fn args(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn xml_call(name: &str, params: &[(&str, &str)]) -> String {
    let mut s = format!("<tool_call>\n<function={name}>\n");
    for (k, v) in params {
        s.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
    }
    s.push_str("</function>\n</tool_call>");
    s
}

// ------------------------------------------------------------------------------------------------
// Plain text and reasoning

#[test]
fn plain_text_has_no_calls() {
    let r = parse("  Hello there!  \n");
    assert_eq!(r.text, "Hello there!");
    assert!(r.calls.is_empty() && r.errors.is_empty() && r.reasoning.is_none());
}

#[test]
fn empty_reply() {
    let r = parse("");
    assert_eq!(r, ParsedReply::default());
}

#[test]
fn explicit_think_block_is_split_off() {
    let r = parse("<think>\nThe user asks a price.\n</think>\n\n这件 99 元。");
    assert_eq!(r.reasoning.as_deref(), Some("The user asks a price."));
    assert_eq!(r.text, "这件 99 元。");
}

#[test]
fn implicit_open_think_from_thinking_prompt() {
    // The generation prompt ends in `<think>\n`, so the reply starts inside the reasoning.
    let r = parse("Let me look it up.\n</think>\n\n好的，我查一下。");
    assert_eq!(r.reasoning.as_deref(), Some("Let me look it up."));
    assert_eq!(r.text, "好的，我查一下。");
}

#[test]
fn empty_think_of_non_thinking_prompt() {
    let r = parse("<think>\n\n</think>\n\nHi!");
    assert_eq!(r.reasoning, None);
    assert_eq!(r.text, "Hi!");
}

#[test]
fn unterminated_think_is_all_reasoning() {
    let r = parse("<think>\nstill thinking about the");
    assert_eq!(r.reasoning.as_deref(), Some("still thinking about the"));
    assert_eq!(r.text, "");
    assert!(r.errors.is_empty());
}

#[test]
fn tool_call_inside_reasoning_is_not_a_call() {
    let r = parse("<think>maybe <tool_call>\n<function=say>\n</function>\n</tool_call>?</think>Sure.");
    assert!(r.calls.is_empty());
    assert_eq!(r.text, "Sure.");
    assert!(r.reasoning.unwrap().contains("<function=say>"));
}

#[test]
fn trailing_end_markers_are_dropped() {
    assert_eq!(parse("Bye!<|im_end|>").text, "Bye!");
    assert_eq!(parse("Bye!<|im_end|>\n<|endoftext|>").text, "Bye!");
}

// ------------------------------------------------------------------------------------------------
// XML format

#[test]
fn xml_call_with_text_before() {
    let out = format!("我帮你查一下价格。\n\n{}", xml_call("get_price", &[("sku", "A-1"), ("qty", "2")]));
    let r = parse(&out);
    assert_eq!(r.text, "我帮你查一下价格。");
    assert_eq!(r.errors, vec![]);
    assert_eq!(r.calls, vec![ToolCall::new("get_price", args(json!({"sku": "A-1", "qty": 2})))]);
}

#[test]
fn xml_call_after_reasoning() {
    let out = format!("Need the price.\n</think>\n\n{}", xml_call("get_price", &[("sku", "B2")]));
    let r = parse(&out);
    assert_eq!(r.reasoning.as_deref(), Some("Need the price."));
    assert_eq!(r.text, "");
    assert_eq!(r.calls[0].arguments["sku"], "B2");
}

#[test]
fn xml_multiple_consecutive_calls() {
    let out = format!(
        "{}\n{}\n{}",
        xml_call("get_price", &[("sku", "A")]),
        xml_call("say", &[("text", "稍等")]),
        xml_call("get_price", &[("sku", "B"), ("member", "true")])
    );
    let r = parse(&out);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let names: Vec<&str> = r.calls.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["get_price", "say", "get_price"]);
    assert_eq!(r.calls[2].arguments["member"], true);
    assert_eq!(r.text, "");
}

#[test]
fn xml_string_values_keep_inner_whitespace_and_strip_one_newline() {
    let out = "<tool_call>\n<function=say>\n<parameter=text>\n\n  第一行\n第二行  \n\n</parameter>\n</function>\n</tool_call>";
    let r = parse(out);
    assert_eq!(r.calls[0].arguments["text"], "\n  第一行\n第二行  \n");
}

#[test]
fn xml_values_on_one_line() {
    let r = parse("<tool_call><function=get_price><parameter=sku>X9</parameter><parameter=qty>3</parameter></function></tool_call>");
    assert!(r.errors.is_empty());
    assert_eq!(r.calls[0].arguments, args(json!({"sku": "X9", "qty": 3})));
}

#[test]
fn xml_string_that_looks_like_a_number_stays_a_string() {
    let r = parse(&xml_call("get_price", &[("sku", "00123")]));
    assert_eq!(r.calls[0].arguments["sku"], "00123");
}

#[test]
fn xml_coerces_every_schema_type() {
    let out = xml_call(
        "get_price",
        &[
            ("sku", "A"),
            ("qty", " 42 "),
            ("discount", "0.85"),
            ("member", "False"),
            ("coupon", "null"),
            ("filters", r#"{"size": "M", "stock": true}"#),
            ("colors", r#"["红", "蓝"]"#),
            ("limit", "null"),
            ("code", "abc"),
            ("level", "2"),
        ],
    );
    let r = parse(&out);
    assert_eq!(r.errors, vec![]);
    assert_eq!(
        Value::Object(r.calls[0].arguments.clone()),
        json!({
            "sku": "A", "qty": 42, "discount": 0.85, "member": false, "coupon": null,
            "filters": {"size": "M", "stock": true}, "colors": ["红", "蓝"], "limit": null,
            "code": "abc", "level": 2,
        })
    );
}

#[test]
fn xml_integer_forms() {
    for (raw, want) in [("7", json!(7)), ("-3", json!(-3)), ("+5", json!(5)), ("5.0", json!(5)), ("18446744073709551615", json!(u64::MAX))] {
        let r = parse(&xml_call("get_price", &[("qty", raw)]));
        assert!(r.errors.is_empty(), "{raw}: {:?}", r.errors);
        assert_eq!(r.calls[0].arguments["qty"], want, "{raw}");
    }
}

#[test]
fn xml_number_forms() {
    for (raw, want) in [("1", 1.0), ("1e3", 1000.0), (".5", 0.5), ("-2.25", -2.25)] {
        let r = parse(&xml_call("get_price", &[("discount", raw)]));
        assert!(r.errors.is_empty(), "{raw}: {:?}", r.errors);
        assert_eq!(r.calls[0].arguments["discount"].as_f64(), Some(want), "{raw}");
    }
}

#[test]
fn xml_type_mismatch_keeps_call_with_raw_string_and_records_error() {
    for (param, raw) in [("qty", "two"), ("qty", "2.5"), ("discount", "cheap"), ("member", "yes"), ("filters", "[1]"), ("colors", "red")] {
        let r = parse(&xml_call("get_price", &[("sku", "A"), (param, raw)]));
        assert_eq!(r.calls.len(), 1, "{param}={raw}");
        assert_eq!(r.calls[0].arguments[param], raw);
        assert_eq!(r.errors.len(), 1, "{param}={raw}");
        let e = &r.errors[0];
        assert_eq!(e.kind, ToolCallErrorKind::TypeMismatch);
        assert_eq!(e.tool.as_deref(), Some("get_price"));
        assert!(e.message.contains(param) && e.message.contains("get_price"), "{}", e.message);
    }
}

#[test]
fn xml_unknown_param_and_unknown_tool_stay_strings() {
    let r = parse(&xml_call("get_price", &[("sku", "A"), ("extra", "5")]));
    assert_eq!(r.calls[0].arguments["extra"], "5");
    let r = parse(&xml_call("not_a_tool", &[("n", "5"), ("o", "{}")]));
    assert_eq!(r.calls[0].name, "not_a_tool");
    assert_eq!(r.calls[0].arguments, args(json!({"n": "5", "o": "{}"})));
    assert!(r.errors.is_empty());
}

#[test]
fn no_schemas_keeps_everything_a_string() {
    let r = parse_reply(&xml_call("get_price", &[("qty", "5")]), &NoSchemas);
    assert_eq!(r.calls[0].arguments["qty"], "5");
}

#[test]
fn schema_map_forms_are_accepted() {
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}});
    let out = xml_call("f", &[("n", "5")]);
    // name → raw parameters schema
    let m: HashMap<String, Value> = [("f".to_string(), schema.clone())].into();
    assert_eq!(parse_reply(&out, &m).calls[0].arguments["n"], 5);
    // name → MCP tool (inputSchema)
    let m: HashMap<String, Value> = [("f".to_string(), json!({"name": "f", "inputSchema": schema.clone()}))].into();
    assert_eq!(parse_reply(&out, &m).calls[0].arguments["n"], 5);
    // a list of bare {"name", "parameters"} specs
    let list = vec![json!({"name": "f", "parameters": schema})];
    assert_eq!(parse_reply(&out, &list).calls[0].arguments["n"], 5);
    assert_eq!(parse_reply(&out, list.as_slice()).calls[0].arguments["n"], 5);
}

#[test]
fn xml_call_without_parameters() {
    let r = parse("<tool_call>\n<function=say>\n</function>\n</tool_call>");
    assert_eq!(r.calls, vec![ToolCall::new("say", Map::new())]);
}

#[test]
fn xml_missing_function_close_is_tolerated_inside_tool_call() {
    let r = parse("<tool_call>\n<function=get_price>\n<parameter=sku>\nA\n</parameter>\n</tool_call>");
    assert!(r.errors.is_empty());
    assert_eq!(r.calls[0].arguments["sku"], "A");
}

#[test]
fn xml_unclosed_tool_call_with_complete_function_is_a_call() {
    // A stream stopped at the `</tool_call>` stop string.
    let r = parse("ok\n<tool_call>\n<function=get_price>\n<parameter=sku>\nA\n</parameter>\n</function>\n");
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.calls.len(), 1);
    assert_eq!(r.text, "ok");
}

#[test]
fn bare_function_without_tool_call_wrapper() {
    let r = parse("好的\n<function=get_price>\n<parameter=qty>\n1\n</parameter>\n</function>\n</tool_call>");
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.calls[0].arguments["qty"], 1);
    assert_eq!(r.text, "好的");
}

#[test]
fn cjk_text_around_calls_and_in_values() {
    let out = format!(
        "宝宝们，这款连衣裙👗有三种颜色！\n{}\n",
        xml_call("get_price", &[("sku", "连衣裙-红色-M"), ("colors", r#"["红色","黑色"]"#)])
    );
    let r = parse(&out);
    assert_eq!(r.text, "宝宝们，这款连衣裙👗有三种颜色！");
    assert_eq!(r.calls[0].arguments["sku"], "连衣裙-红色-M");
    assert_eq!(r.calls[0].arguments["colors"], json!(["红色", "黑色"]));
}

#[test]
fn text_between_and_after_calls_is_kept() {
    let out = format!("A {} B {} C", xml_call("say", &[("text", "1")]), xml_call("say", &[("text", "2")]));
    let r = parse(&out);
    assert_eq!(r.calls.len(), 2);
    assert_eq!(r.text, "A  B  C");
}

// ------------------------------------------------------------------------------------------------
// JSON format

#[test]
fn json_call() {
    let out = "Checking.\n<tool_call>\n{\"name\": \"get_price\", \"arguments\": {\"sku\": \"A\", \"qty\": 2}}\n</tool_call>";
    let r = parse(out);
    assert_eq!(r.text, "Checking.");
    assert!(r.errors.is_empty());
    assert_eq!(r.calls, vec![ToolCall::new("get_price", args(json!({"sku": "A", "qty": 2})))]);
}

#[test]
fn json_call_with_string_arguments() {
    let r = parse(r#"<tool_call>{"name": "say", "arguments": "{\"text\": \"你好\"}"}</tool_call>"#);
    assert!(r.errors.is_empty());
    assert_eq!(r.calls[0].arguments["text"], "你好");
}

#[test]
fn json_call_without_arguments() {
    let r = parse(r#"<tool_call>{"name": "say"}</tool_call>"#);
    assert_eq!(r.calls, vec![ToolCall::new("say", Map::new())]);
}

#[test]
fn json_multiple_calls_and_mixed_formats() {
    let out = format!(
        "<tool_call>\n{{\"name\": \"say\", \"arguments\": {{\"text\": \"a\"}}}}\n</tool_call>\n{}",
        xml_call("get_price", &[("qty", "4")])
    );
    let r = parse(&out);
    assert_eq!(r.calls.len(), 2);
    assert_eq!(r.calls[0].name, "say");
    assert_eq!(r.calls[1].arguments["qty"], 4);
}

#[test]
fn json_after_think() {
    let r = parse("<think>hmm</think>\n<tool_call>\n{\"name\": \"say\", \"arguments\": {\"text\": \"x\"}}\n</tool_call>");
    assert_eq!(r.reasoning.as_deref(), Some("hmm"));
    assert_eq!(r.calls.len(), 1);
}

// ------------------------------------------------------------------------------------------------
// Malformed calls

fn only_error(s: &str) -> ToolCallErrorKind {
    let r = parse(s);
    assert!(r.calls.is_empty(), "{s:?} → {:?}", r.calls);
    assert_eq!(r.errors.len(), 1, "{s:?} → {:?}", r.errors);
    assert!(!r.errors[0].message.is_empty());
    assert!(!r.errors[0].snippet.is_empty());
    r.errors[0].kind
}

#[test]
fn malformed_unclosed_tool_call() {
    assert_eq!(only_error("<tool_call>\n<function=get_price>\n<parameter=sku>\nA"), ToolCallErrorKind::UnclosedToolCall);
    assert_eq!(only_error("<tool_call>\n<function=get_price>\n<parameter=sku>\nA\n</parameter>\n"), ToolCallErrorKind::UnclosedToolCall);
    assert_eq!(only_error("<tool_call>\n"), ToolCallErrorKind::UnclosedToolCall);
    assert_eq!(only_error("<tool_call>\n{\"name\": \"say\", \"argu"), ToolCallErrorKind::UnclosedToolCall);
    assert_eq!(only_error("<function=get_price>\n<parameter=sku>\nA"), ToolCallErrorKind::UnclosedToolCall);
}

#[test]
fn malformed_missing_function() {
    assert_eq!(only_error("<tool_call>\n</tool_call>"), ToolCallErrorKind::MissingFunction);
    assert_eq!(only_error("<tool_call>\nget_price(sku=A)\n</tool_call>"), ToolCallErrorKind::MissingFunction);
    assert_eq!(only_error("<tool_call>\n<parameter=sku>\nA\n</parameter>\n</tool_call>"), ToolCallErrorKind::MissingFunction);
}

#[test]
fn malformed_function_tag() {
    assert_eq!(only_error("<tool_call>\n<function=>\n</function>\n</tool_call>"), ToolCallErrorKind::MalformedFunction);
    assert_eq!(only_error("<tool_call>\n<function=get_price\n</tool_call>"), ToolCallErrorKind::MalformedFunction);
}

#[test]
fn malformed_unterminated_parameter() {
    let s = "<tool_call>\n<function=get_price>\n<parameter=sku>\nA\n</function>\n</tool_call>";
    assert_eq!(only_error(s), ToolCallErrorKind::UnterminatedParameter);
    let e = &parse(s).errors[0];
    assert_eq!(e.tool.as_deref(), Some("get_price"));
    assert!(e.message.contains("sku"));
}

#[test]
fn malformed_parameter_tag() {
    assert_eq!(
        only_error("<tool_call>\n<function=say>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>"),
        ToolCallErrorKind::MalformedParameter
    );
    assert_eq!(
        only_error("<tool_call>\n<function=say>\n<parameter=text\n</function>\n</tool_call>"),
        ToolCallErrorKind::MalformedParameter
    );
}

#[test]
fn malformed_json() {
    assert_eq!(only_error("<tool_call>\n{\"name\": \"say\", }\n</tool_call>"), ToolCallErrorKind::InvalidJson);
    assert_eq!(only_error("<tool_call>\n{\"name\": \"say\"} trailing\n</tool_call>"), ToolCallErrorKind::InvalidJson);
    assert_eq!(only_error("<tool_call>\n{\"arguments\": {}}\n</tool_call>"), ToolCallErrorKind::MissingName);
    assert_eq!(only_error("<tool_call>\n{\"name\": \"say\", \"arguments\": \"{bad\"}\n</tool_call>"), ToolCallErrorKind::InvalidArguments);
    assert_eq!(only_error("<tool_call>\n{\"name\": \"say\", \"arguments\": [1]}\n</tool_call>"), ToolCallErrorKind::InvalidArguments);
}

#[test]
fn a_malformed_call_does_not_hide_good_ones() {
    let out = format!("{}\n<tool_call>\n</tool_call>\n{}", xml_call("say", &[("text", "a")]), xml_call("say", &[("text", "b")]));
    let r = parse(&out);
    assert_eq!(r.calls.len(), 2);
    assert_eq!(r.errors.len(), 1);
    assert_eq!(r.errors[0].kind, ToolCallErrorKind::MissingFunction);
}

#[test]
fn errors_serialize_with_snake_case_kind() {
    let r = parse("<tool_call>\n</tool_call>");
    let v = serde_json::to_value(&r.errors[0]).unwrap();
    assert_eq!(v["kind"], "missing_function");
    assert_eq!(r.errors[0].to_string().split(':').next(), Some("missing_function"));
}

// ------------------------------------------------------------------------------------------------
// Rendering round trip

#[test]
fn render_then_parse_round_trips() {
    let calls = vec![
        ToolCall::new(
            "get_price",
            args(json!({"sku": "连衣裙", "qty": 2, "discount": 0.5, "member": true, "filters": {"a": [1, 2]}, "colors": ["x"], "coupon": null})),
        ),
        ToolCall::new("say", args(json!({"text": "多行\n文本"}))),
    ];
    let rendered = render_assistant_tool_calls(&calls);
    assert!(rendered.starts_with("<tool_call>\n<function=get_price>\n<parameter=sku>\n连衣裙\n</parameter>\n"));
    let r = parse(&rendered);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.calls, calls);

    let whole = render_assistant_reply(Some("think"), "稍等", &calls);
    let r = parse(&whole);
    assert_eq!(r.reasoning.as_deref(), Some("think"));
    assert_eq!(r.text, "稍等");
    assert_eq!(r.calls, calls);
}

#[test]
fn openai_conversion() {
    let c = ToolCall::new("say", args(json!({"text": "hi"})));
    let v = c.to_openai("call_0");
    assert_eq!(v["function"]["arguments"]["text"], "hi");
    assert_eq!(ToolCall::from_openai(&v).unwrap(), c);
    let wire = json!({"id": "x", "type": "function", "function": {"name": "say", "arguments": "{\"text\":\"hi\"}"}});
    assert_eq!(ToolCall::from_openai(&wire).unwrap(), c);
    assert_eq!(
        ToolCall::from_openai(&json!({"function": {"arguments": "{}"}})).unwrap_err().kind,
        ToolCallErrorKind::MissingName
    );
}

// ------------------------------------------------------------------------------------------------
// Never panics

/// xorshift64*: a tiny deterministic PRNG for the fuzz loops.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn fuzz_random_bytes_never_panic() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..3000 {
        let len = rng.below(200);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let s = String::from_utf8_lossy(&bytes);
        let _ = parse(&s);
    }
}

#[test]
fn fuzz_tag_soup_never_panics() {
    let pieces = [
        "<tool_call>", "</tool_call>", "<function=", "<function=get_price>", "</function>", "<parameter=",
        "<parameter=qty>", "<parameter=sku>", "</parameter>", "<think>", "</think>", ">", "<", "\n", "{", "}",
        "\"name\"", ":", "\"say\"", "\"arguments\"", "[", "]", "12", "null", "true", "价格", "👗", " ",
        "<|im_end|>", "\r\n", "=", "\"",
    ];
    let mut rng = Rng(42);
    for _ in 0..20000 {
        let n = rng.below(24);
        let s: String = (0..n).map(|_| pieces[rng.below(pieces.len())]).collect();
        let r = parse(&s);
        // Invariant: every error has a kind and message; calls have names.
        for c in &r.calls {
            assert!(!c.name.is_empty(), "{s:?}");
        }
        for e in &r.errors {
            assert!(!e.message.is_empty(), "{s:?}");
        }
    }
}

#[test]
fn fuzz_truncations_of_a_valid_reply_never_panic() {
    let full = format!(
        "<think>\n想一想\n</think>\n\n好的！{}\n<tool_call>\n{{\"name\": \"say\", \"arguments\": {{\"text\": \"价格\"}}}}\n</tool_call>",
        xml_call("get_price", &[("sku", "连衣裙"), ("qty", "2")])
    );
    for (i, _) in full.char_indices() {
        let _ = parse(&full[..i]);
        let _ = parse(&full[i..]);
    }
    let r = parse(&full);
    assert_eq!(r.calls.len(), 2);
    assert!(r.errors.is_empty());
}
