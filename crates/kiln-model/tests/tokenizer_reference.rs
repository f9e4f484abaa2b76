//! kiln's tokenizer and chat templates against the references the fixture script recorded:
//! ids from the Python `tokenizers` library (checked there against `transformers`), and
//! `transformers`' `apply_chat_template` output for the real Llama 3.2 and Qwen2.5
//! templates, with and without a generation prompt, multi-turn, and with a tool.

use std::fs;
use std::path::{Path, PathBuf};

use kiln_model::Tokenizer;
use kiln_model::chat_template::{ChatMessage, ChatTemplate};
use serde_json::{Map, Value};

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models")
}

fn references() -> Value {
    let text = fs::read_to_string(models_dir().join("references/tokenizers.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The checkpoints sharing each recorded tokenizer: the Hugging Face original and the
/// mlx-lm conversion, which stores the template in chat_template.jinja instead.
const FAMILIES: [(&str, &[&str]); 2] = [
    ("llama3-tiny", &["llama3-tiny", "llama3-tiny-4bit-g64"]),
    ("qwen2-tiny", &["qwen2-tiny", "qwen2-tiny-4bit"]),
];

fn date() -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("date_string".into(), "26 Jul 2024".into());
    m
}

#[test]
fn encodings_match_the_tokenizers_library() {
    let refs = references();
    for (family, dirs) in FAMILIES {
        for dir in dirs {
            let tok = Tokenizer::from_dir(&models_dir().join(dir)).unwrap();
            for case in refs[family]["encode"].as_array().unwrap() {
                let text = case["text"].as_str().unwrap();
                let ids = |k: &str| -> Vec<u32> {
                    case[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
                };
                assert_eq!(
                    tok.encode(text, true).unwrap(),
                    ids("ids_with_special"),
                    "{dir}: {text:?} with specials"
                );
                assert_eq!(tok.encode(text, false).unwrap(), ids("ids"), "{dir}: {text:?}");
                assert_eq!(
                    tok.decode(&ids("ids_with_special")).unwrap(),
                    case["decoded"].as_str().unwrap(),
                    "{dir}"
                );
            }
        }
    }
}

#[test]
fn llama_3_2_and_qwen_2_5_templates_render_as_transformers_does() {
    let refs = references();
    for (family, dirs) in FAMILIES {
        let chats = refs[family]["chats"].as_object().unwrap();
        for dir in dirs {
            let t = ChatTemplate::from_dir(&models_dir().join(dir)).unwrap().expect("a chat template");
            for (name, messages) in chats {
                let messages: Vec<ChatMessage> = serde_json::from_value(messages.clone()).unwrap();
                for generation in [true, false] {
                    let key = format!("{name}/{}", if generation { "gen" } else { "nogen" });
                    let want = refs[family]["chat"][&key].as_str().unwrap();
                    let got = t.render_with(&messages, generation, &date()).unwrap();
                    assert_eq!(got, want, "{dir}: {key}");
                }
            }
            let mut extra = date();
            extra.insert("tools".into(), Value::Array(vec![refs[family]["tool"].clone()]));
            let user: Vec<ChatMessage> = serde_json::from_value(chats["user_only"].clone()).unwrap();
            let got = t.render_with(&user, true, &extra).unwrap();
            assert_eq!(got, refs[family]["chat"]["tools/gen"].as_str().unwrap(), "{dir}: tools");
        }
    }
}

#[test]
fn the_rendered_prompt_encodes_to_the_reference_prompt() {
    // The fixture script built each reference prompt from the chat template, encoded
    // without specials; kiln must arrive at the same ids from the same text.
    for (dir, text) in
        [("llama3-tiny", "Tell me a story about a fox."), ("qwen2-tiny", "What is the capital of France?")]
    {
        let d = models_dir().join(dir);
        let t = ChatTemplate::from_dir(&d).unwrap().unwrap();
        let tok = Tokenizer::from_dir(&d).unwrap();
        let rendered = t.render_with(&[ChatMessage::user(text)], true, &date()).unwrap();
        let ids = tok.encode(&rendered, false).unwrap();
        let bytes = fs::read(models_dir().join(format!("references/{dir}.safetensors"))).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let want: Vec<u32> = st
            .tensor("prompt_ids")
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(ids, want, "{dir}");
    }
}

#[test]
fn llama_3_2_reads_todays_date_when_none_is_given() {
    let t = ChatTemplate::from_dir(&models_dir().join("llama3-tiny")).unwrap().unwrap();
    let out = t.render_prompt("hi").unwrap();
    let today = chrono::Local::now().format("%d %b %Y").to_string();
    // A render that straddles midnight may see yesterday; accept either.
    let yesterday = (chrono::Local::now() - chrono::Duration::days(1)).format("%d %b %Y").to_string();
    assert!(
        out.contains(&format!("Today Date: {today}\n"))
            || out.contains(&format!("Today Date: {yesterday}\n")),
        "{out}"
    );
    assert!(out.starts_with("<|begin_of_text|><|start_header_id|>system<|end_header_id|>"), "{out}");
    assert!(out.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"), "{out}");
}

#[test]
fn a_checkpoint_without_a_template_has_none() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("tokenizer_config.json"), r#"{"bos_token": "<s>"}"#).unwrap();
    assert!(ChatTemplate::from_dir(tmp.path()).unwrap().is_none());
    assert!(ChatTemplate::from_dir(&tmp.path().join("absent")).unwrap().is_none());
}

#[test]
fn a_named_template_list_uses_default_and_special_tokens_fall_back() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(
        tmp.path().join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "tool_use", "template": "tools"},
                              {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}]}"#,
    )
    .unwrap();
    fs::write(
        tmp.path().join("special_tokens_map.json"),
        r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>"}"#,
    )
    .unwrap();
    let t = ChatTemplate::from_dir(tmp.path()).unwrap().unwrap();
    assert_eq!(t.render(&[ChatMessage::user("x")], false).unwrap(), "<s>x</s>");
}

#[test]
fn a_broken_template_names_its_file() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("chat_template.jinja"), "{% if %}").unwrap();
    let e = ChatTemplate::from_dir(tmp.path()).unwrap_err().to_string();
    assert!(e.contains("chat_template.jinja") && e.contains("chat template"), "{e}");
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("tokenizer.json"), "{}").unwrap();
    let e = Tokenizer::from_dir(tmp.path()).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json") && e.contains("tokenizer.json"), "{e}");
}
