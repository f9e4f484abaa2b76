//! `cargo xtask report A B` as a reader meets it: runs built here with known
//! repetitions (a noisy pair of equal settings, a clear change), the verdict each cell
//! gets, the terminal's sheet against compare.html's cells, and the settings that
//! differ, compared as data; then two real sweeps whose env.json must carry every knob.

#[allow(dead_code)]
mod util;

use std::fs;
use std::path::{Path, PathBuf};

use util::{Run, Sandbox};

/// The sweep CSV's header, as the harness writes it.
const HEADER: &str = "model,model_path,prompt_tokens,generated_tokens,prefill_ms,prefill_tok_s,decode_ms,decode_tok_s,peak_bytes,max_rss_bytes,date,host,device,backend,kiln_version,commit,features,driver_version,cuda_version,max_tokens,warmup_tokens,attention,prefill_chunk,kv_dtype,memory_limit_bytes,threads,prompt,prompt_target_len,status,repetition,engine,engine_version,reason,disturbed";

/// A sweep run directory `name` under `sb` whose one cell (synthetic:tiny at 64 tokens)
/// measured `decode` and `prefill` tok/s, one repetition each; `env` is env.json's text
/// without its `output` key (added here).
fn sweep_run(sb: &Sandbox, name: &str, env: &str, decode: &[f64], prefill: &[f64]) -> PathBuf {
    let dir = sb.path(name);
    fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("rows.csv");
    let mut text = format!("{HEADER}\n");
    for (i, (d, p)) in decode.iter().zip(prefill).enumerate() {
        text.push_str(&format!(
            "synthetic:tiny,synthetic:tiny,64,8,1.0,{p},1.0,{d},1000,2000,2026-12-07T00:00:00Z,h,cpu,cpu,0.1.0,abc,,,,8,1,,,,,,,64,ok,{},kiln,0.1.0,,\n",
            i + 1
        ));
    }
    fs::write(&csv, text).unwrap();
    let env = env.trim().strip_suffix('}').unwrap().trim_end();
    let sep = if env.ends_with('{') { "" } else { "," };
    fs::write(dir.join("env.json"), format!("{env}{sep} \"output\": {:?}}}\n", csv.to_str().unwrap()))
        .unwrap();
    dir
}

/// Runs `cargo xtask report` on `dirs` with `extra` flags.
fn report(sb: &Sandbox, dirs: &[&Path], extra: &[&str]) -> Run {
    let mut args: Vec<&str> = dirs.iter().map(|d| d.to_str().unwrap()).collect();
    args.extend_from_slice(extra);
    sb.run("report", &args)
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

/// The rows of the page's table titled `title`: each cell's text.
fn html_rows(page: &str, title: &str) -> Vec<Vec<String>> {
    let Some(at) = page.find(&format!("<h2>{title}</h2>")) else { return Vec::new() };
    let rest = &page[at..];
    let table = &rest[..rest.find("</table>").unwrap()];
    table
        .lines()
        .filter(|l| l.contains("<td"))
        .map(|l| {
            let mut cells: Vec<String> = l
                .split("</td>")
                .map(|c| c.rsplit_once('>').map_or(String::new(), |(_, t)| unescape(t)))
                .collect();
            cells.pop(); // what follows the last </td>
            cells
        })
        .collect()
}

/// The rows of the terminal's markdown table titled `title`.
fn md_rows(md: &str, title: &str) -> Vec<Vec<String>> {
    let Some(at) = md.find(&format!("{title}:\n")) else { return Vec::new() };
    md[at..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| {
            l.trim()
                .trim_start_matches("| ")
                .trim_end_matches(" |")
                .split(" | ")
                .map(|c| c.replace("\\|", "|"))
                .collect()
        })
        .collect()
}

/// The terminal's sheet and compare.html say the same, cell for cell.
fn same_cells(run: &Run, page: &str, title: &str) -> Vec<Vec<String>> {
    let md = md_rows(&run.stdout, title);
    let html = html_rows(page, title);
    assert!(!md.is_empty(), "no {title} table on the terminal{run}");
    assert_eq!(html, md, "compare.html's {title} is not the terminal's{run}\n{page}");
    md
}

const ENV_A: &str = r#"{"command": ["xtask", "bench-longprompt"], "started": "2026-12-07T10:00:00Z", "commit": "abc", "backend": "cpu", "kv_dtype": null, "threads": null, "max_tokens": 8, "warmup_tokens": 1, "models": ["synthetic:tiny"], "lengths": [64], "kiln_env": {"KILN_A": "1", "KILN_B": "2"}}"#;
/// The same settings, keys in another order (as serde_json's preserve_order may write).
const ENV_A_REORDERED: &str = r#"{"kiln_env": {"KILN_B": "2", "KILN_A": "1"}, "lengths": [64], "models": ["synthetic:tiny"], "warmup_tokens": 1, "max_tokens": 8, "threads": null, "kv_dtype": null, "backend": "cpu", "commit": "abc", "started": "2026-12-07T11:00:00Z", "command": ["xtask", "bench-longprompt", "--repeat", "3"]}"#;

#[test]
fn a_noisy_compare_of_equal_settings_is_undecided_and_the_page_is_the_terminal_s_sheet() {
    let sb = Sandbox::new();
    // Two runs of the same settings on a loaded machine: a bare ratio of means reads
    // this as prefill B/A 0.208.
    let a = sweep_run(&sb, "a", ENV_A, &[40.0, 90.0, 20.0], &[26000.0, 31000.0, 4000.0]);
    let b = sweep_run(&sb, "b", ENV_A_REORDERED, &[70.0, 25.0, 50.0], &[3100.0, 9000.0, 1800.0]);
    let run = report(&sb, &[&a, &b], &[]);
    run.expect_code(0).expect_stderr("comparison: ");
    let page = fs::read_to_string(b.join("compare.html")).unwrap();
    let rows = same_cells(&run, &page, "Per cell");
    let prefill = rows.iter().find(|r| r[1] == "prefill tok/s").unwrap();
    assert!(prefill[4].contains("(n=3, ") && prefill[4].contains("undecided at ±5%"), "{prefill:?}");
    assert!(!prefill[4].contains("regressed"), "{prefill:?}");
    assert!(prefill[2].contains("(n=3, "), "each run's own reading carries its n: {prefill:?}");
    let headline = "B vs A: 0 regressed, 0 improved, 0 same within ±5%, 2 undecided";
    run.expect_stdout(headline);
    assert!(page.contains(&format!("<strong>{headline}</strong>")), "{page}");
    // Key order is not a difference: every setting that can change a measurement is equal.
    run.expect_stdout("Settings: every setting that can change a measurement is equal");
    assert!(!page.contains("<h2>Settings that differ</h2>") && !page.contains("(differs)"), "{page}");
}

#[test]
fn a_quiet_compare_of_a_clear_change_is_regressed_at_the_margin_given() {
    let sb = Sandbox::new();
    let a = sweep_run(&sb, "a", ENV_A, &[100.0, 101.0, 99.0, 100.5], &[5000.0, 5010.0, 4990.0, 5005.0]);
    let b = sweep_run(&sb, "b", ENV_A, &[50.0, 50.5, 49.5, 50.2], &[5100.0, 5110.0, 5090.0, 5105.0]);
    let run = report(&sb, &[&a, &b], &[]);
    run.expect_code(0);
    let page = fs::read_to_string(b.join("compare.html")).unwrap();
    let rows = same_cells(&run, &page, "Per cell");
    let decode = rows.iter().find(|r| r[1] == "decode tok/s").unwrap();
    assert!(decode[4].starts_with("0.50") && decode[4].ends_with("regressed by more than 5%"), "{decode:?}");
    let prefill = rows.iter().find(|r| r[1] == "prefill tok/s").unwrap();
    assert!(prefill[4].ends_with("same within ±5%"), "{prefill:?}");
    run.expect_stdout("B vs A: 1 regressed, 0 improved, 1 same within ±5%, 0 undecided");
    // A margin the user gives judges every ratio: prefill's 2% is then a change.
    let narrow = report(&sb, &[&a, &b], &["--margin", "1"]);
    narrow.expect_code(0).expect_stdout("B vs A: 1 regressed, 1 improved, 0 same within ±1%, 0 undecided");
    // One repetition a side: no interval, so no verdict, never a bare ratio.
    let one_a = sweep_run(&sb, "one-a", ENV_A, &[100.0], &[5000.0]);
    let one_b = sweep_run(&sb, "one-b", ENV_A, &[20.0], &[5000.0]);
    let one = report(&sb, &[&one_a, &one_b], &[]);
    one.expect_code(0).expect_stdout("0.200 (n=1: no interval) undecided: n=1, no interval yet");
    one.expect_stdout("B vs A: 0 regressed, 0 improved, 0 same within ±5%, 2 undecided");
    // A margin without a comparison is refused, saying why.
    report(&sb, &[&a], &["--margin", "3"]).expect_code(2).expect_stderr("--margin judges a comparison");
}

#[test]
fn the_settings_that_differ_are_listed_by_name_and_value() {
    let sb = Sandbox::new();
    let f32_env = ENV_A
        .replace(r#""kv_dtype": null"#, r#""kv_dtype": "f32""#)
        .replace(r#""KILN_B": "2""#, r#""KILN_B": "3""#);
    let a = sweep_run(&sb, "a", ENV_A_REORDERED, &[100.0, 101.0], &[5000.0, 5010.0]);
    let b = sweep_run(&sb, "b", &f32_env, &[100.0, 101.0], &[5000.0, 5010.0]);
    let run = report(&sb, &[&a, &b], &[]);
    run.expect_code(0);
    let page = fs::read_to_string(b.join("compare.html")).unwrap();
    let rows = same_cells(&run, &page, "Settings that differ");
    assert_eq!(
        rows,
        [["kiln_env.KILN_B", "2", "3"], ["kv_dtype", "-", "f32"]].map(|r| r.map(String::from).to_vec()),
        "{run}"
    );
}

/// A serve-bench run directory: levels.csv with one level and its requests.
fn serve_run(sb: &Sandbox, name: &str, env: &str, tpot: &[f64], disturbed: &str) -> PathBuf {
    let dir = sb.path(name);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("env.json"), env).unwrap();
    let n = tpot.len();
    fs::write(
        dir.join("levels.csv"),
        format!(
            "level,concurrency,requests,ok,failed,wall_s,output_tokens,output_tok_s,tpot_ms_p50,disturbed\nc=2,2,{n},{n},0,2.0,64,32.0,{},{disturbed}\n",
            tpot[n / 2]
        ),
    )
    .unwrap();
    let mut reqs = String::new();
    for (i, t) in tpot.iter().enumerate() {
        reqs.push_str(&format!(
            "{{\"level\":\"c=2\",\"key\":\"c=2/{i}\",\"ok\":true,\"warmup\":false,\"ttft_ms\":100.0,\"tpot_ms\":{t},\"e2e_ms\":500.0}}\n"
        ));
    }
    // A warm-up request is no observation.
    reqs.push_str(
        "{\"level\":\"c=2\",\"key\":\"c=2/warmup/0\",\"ok\":true,\"warmup\":true,\"tpot_ms\":9000.0}\n",
    );
    fs::write(dir.join("requests.jsonl"), reqs).unwrap();
    dir
}

#[test]
fn two_serve_bench_runs_of_one_setting_are_undecided_and_equal_in_any_key_order() {
    let sb = Sandbox::new();
    let env_a = r#"{"command": ["xtask", "serve-bench"], "commit": "abc", "serve_bench": {"levels": ["c=2"], "max_tokens": 32, "prompt_tokens": 128, "endpoint": "completions"}}"#;
    let env_b = r#"{"serve_bench": {"endpoint": "completions", "prompt_tokens": 128, "max_tokens": 32, "levels": ["c=2"]}, "commit": "abc", "command": ["xtask", "serve-bench"]}"#;
    // Noisy TPOT: the bare ratio of the two levels' medians read 0.300.
    let a = serve_run(&sb, "a", env_a, &[30.0, 90.0, 45.0, 120.0, 60.0, 40.0, 200.0, 35.0], "");
    let b = serve_run(
        &sb,
        "b",
        env_b,
        &[25.0, 110.0, 22.0, 60.0, 18.0, 150.0, 29.0, 24.0],
        "other processes used 1.20 CPUs (limit 0.50); load average 3.00",
    );
    let run = report(&sb, &[&a, &b], &[]);
    run.expect_code(0);
    let page = fs::read_to_string(b.join("compare.html")).unwrap();
    let rows = same_cells(&run, &page, "Per cell");
    let tpot = rows.iter().find(|r| r[1] == "TPOT ms").unwrap();
    assert!(tpot[2].contains("(n=8, "), "{tpot:?}");
    // Every request of the disturbed level counts as disturbed.
    assert!(tpot[3].ends_with(", 8 disturbed)"), "{tpot:?}");
    // The requests share their run's machine: the ratio rests on one value a run, so
    // it is undecided, never "0.489" nor a verdict from the requests' spread.
    assert_eq!(tpot[4], "0.639 (n=1: no interval, 1 disturbed) undecided: n=1, no interval yet", "{tpot:?}");
    run.expect_stdout("B vs A: 0 regressed, 0 improved, 0 same within ±5%, 4 undecided");
    run.expect_stdout("Settings: every setting that can change a measurement is equal");
}

#[test]
fn two_real_sweeps_differ_by_their_kv_dtype_and_by_nothing_else() {
    let sb = Sandbox::new();
    let sweep =
        ["--models", "synthetic:tiny", "--lengths", "16", "--max-tokens", "4", "--warmup-tokens", "1"];
    sb.run("bench-longprompt", &sweep).expect_code(0);
    let mut f32_sweep = sweep.to_vec();
    let b_csv = sb.path("b.csv");
    f32_sweep.extend(["--kv-dtype", "f32", "--output", b_csv.to_str().unwrap()]);
    sb.run("bench-longprompt", &f32_sweep).expect_code(0);
    let mut dirs: Vec<PathBuf> = fs::read_dir(sb.path("runs")).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.sort();
    assert_eq!(dirs.len(), 2);
    // Every knob that changes a measurement is in env.json.
    let env: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dirs[1].join("env.json")).unwrap()).unwrap();
    for (key, want) in [
        ("kv_dtype", serde_json::json!("f32")),
        ("threads", serde_json::Value::Null),
        ("max_tokens", serde_json::json!(4)),
        ("warmup_tokens", serde_json::json!(1)),
        ("models", serde_json::json!(["synthetic:tiny"])),
        ("lengths", serde_json::json!([16])),
        ("prefill_chunk", serde_json::Value::Null),
        ("attention", serde_json::Value::Null),
        ("backend", serde_json::json!("cpu")),
    ] {
        assert_eq!(env.get(key), Some(&want), "env.json's {key}: {env}");
    }
    let run = report(&sb, &[&dirs[0], &dirs[1]], &[]);
    run.expect_code(0);
    let page = fs::read_to_string(dirs[1].join("compare.html")).unwrap();
    let rows = same_cells(&run, &page, "Settings that differ");
    assert_eq!(rows, [["kv_dtype", "-", "f32"].map(String::from).to_vec()], "{run}");
    same_cells(&run, &page, "Per cell");
}
