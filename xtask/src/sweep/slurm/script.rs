//! The Slurm plan, as pure functions: the cells grouped into one job array per model
//! (shortest prompt first, throttled to one task at a time with `%1`), the dependencies
//! that hold `--max-parallel`, and the text of each batch script.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;

use super::super::plan::Plan;
use super::super::task::ArrayPlan;
use crate::console::usage;
use crate::shell;

/// What `#SBATCH` lines the user asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SbatchOptions {
    /// `--partition`.
    pub partition: Option<String>,
    /// `--account`.
    pub account: Option<String>,
    /// `--time` (per cell).
    pub time: Option<String>,
    /// `--gres`.
    pub gres: Option<String>,
    /// `--sbatch-arg`, each passed as given.
    pub extra: Vec<String>,
}

/// One array per model, in plan order. A model's cells run in ascending prompt length
/// (ties in plan order), so the backstop sees every shorter length of the model before a
/// longer one starts. With `max_parallel` N, array j starts after array j-N has ended
/// (`afterany`), so at most N models run at once.
pub fn arrays(plan: &Plan, max_parallel: Option<usize>) -> Vec<ArrayPlan> {
    let mut by_model: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, cell) in plan.cells.iter().enumerate() {
        match by_model.iter_mut().find(|(m, _)| *m == cell.model) {
            Some((_, cells)) => cells.push(i),
            None => by_model.push((cell.model.clone(), vec![i])),
        }
    }
    by_model
        .into_iter()
        .enumerate()
        .map(|(j, (model, mut cells))| {
            cells.sort_by_key(|&i| (plan.cells[i].layer_len(), i));
            let after = max_parallel.filter(|&n| n > 0 && j >= n).map(|n| j - n);
            ArrayPlan { model, cells, after }
        })
        .collect()
}

/// Checks what reaches a batch script from outside: an `#SBATCH` value or the run
/// directory holding a control character (a newline would end the `#SBATCH` line and
/// make the rest a command), or a `KILN_*` variable whose name is no shell name (it would
/// be written into an `export` line), is a usage error naming it. Values of the
/// variables are quoted, so they may hold anything.
pub fn check_inputs(run_dir: &Path, opts: &SbatchOptions, kiln_env: &BTreeMap<String, String>) -> Result<()> {
    let named = [
        ("--partition", &opts.partition),
        ("--account", &opts.account),
        ("--time", &opts.time),
        ("--gres", &opts.gres),
    ];
    let values = named
        .iter()
        .filter_map(|(flag, v)| v.as_deref().map(|v| (*flag, v)))
        .chain(opts.extra.iter().map(|v| ("--sbatch-arg", v.as_str())));
    for (flag, v) in values {
        if let Some(c) = shell::control_char(v) {
            usage!(
                "{flag} {v:?}: holds the control character {c:?}, which would end its #SBATCH line: expected one sbatch option on one line"
            );
        }
    }
    let run = run_dir.to_string_lossy();
    if let Some(c) = shell::control_char(&run) {
        usage!("--shared-dir {run:?}: holds the control character {c:?}: expected a path on one line");
    }
    if let Some(bad) = kiln_env.keys().find(|k| !shell::is_name(k)) {
        usage!(
            "the inherited environment variable {bad:?} is not a shell variable name (letters, digits and _), so it cannot be exported to the Slurm tasks: unset it (env -u) and submit again"
        );
    }
    Ok(())
}

/// The batch script of array `j`: its `#SBATCH` lines (name, array with its `%1`
/// throttle, where Slurm writes the task's output, the user's options), the submitting
/// `KILN_*` environment, and one `xtask sweep-task` call for the task's cell. What came
/// from outside is checked by [`check_inputs`] first; the comment lines show a control
/// character as `?`.
pub fn batch_script(
    run_dir: &Path,
    command: &str,
    j: usize,
    array: &ArrayPlan,
    plan: &Plan,
    opts: &SbatchOptions,
    kiln_env: &BTreeMap<String, String>,
) -> Result<String> {
    check_inputs(run_dir, opts, kiln_env)?;
    let run = run_dir.display().to_string();
    let mut s = String::from("#!/bin/bash\n");
    let mut sb = |line: String| {
        s.push_str("#SBATCH ");
        s.push_str(&line);
        s.push('\n');
    };
    sb(format!("--job-name=kiln-{command}-{}", j + 1));
    sb(format!("--array=0-{}%1", array.cells.len().saturating_sub(1)));
    sb(format!("--output={run}/slurm/{}-%A_%a.out", j + 1));
    sb("--ntasks=1".into());
    for (flag, v) in [
        ("partition", &opts.partition),
        ("account", &opts.account),
        ("time", &opts.time),
        ("gres", &opts.gres),
    ] {
        if let Some(v) = v {
            sb(format!("--{flag}={v}"));
        }
    }
    for extra in &opts.extra {
        sb(extra.clone());
    }
    let labels: Vec<String> = array.cells.iter().map(|&i| plan.cells[i].label()).collect();
    s.push_str(&format!(
        "# kiln sweep {run}: model {}, one task per cell, one at a time (%1), shortest prompt first:\n# {}\n",
        shell::comment_text(&array.model),
        shell::comment_text(&labels.join(" "))
    ));
    s.push_str("set -eu\n");
    for (k, v) in kiln_env {
        s.push_str(&format!("export {k}={}\n", shell::quote(v)));
    }
    let cells: Vec<String> = array.cells.iter().map(usize::to_string).collect();
    s.push_str(&format!("cells=({})\n", cells.join(" ")));
    s.push_str(&format!(
        "exec {} sweep-task {} \"${{cells[$SLURM_ARRAY_TASK_ID]}}\"\n",
        shell::quote(&format!("{run}/bin/xtask")),
        shell::quote(&run)
    ));
    Ok(s)
}

/// The `sbatch` arguments for array `j`, given the job ids of the arrays submitted before
/// it (`None` in a dry run: the dependency is shown as `$JOB_<n>`).
pub fn sbatch_args(array: &ArrayPlan, script: &Path, job_ids: Option<&[String]>) -> Vec<String> {
    let mut a = vec!["--parsable".to_string()];
    if let Some(after) = array.after {
        let id = match job_ids {
            Some(ids) => ids[after].clone(),
            None => format!("$JOB_{}", after + 1),
        };
        a.push(format!("--dependency=afterany:{id}"));
    }
    a.push(script.display().to_string());
    a
}

#[cfg(test)]
mod tests {
    use super::super::super::plan::{CellTemplate, Named, Prompt};
    use super::*;

    fn plan(models: &[&str], lengths: &[u64]) -> Plan {
        let models: Vec<String> = models.iter().map(|m| m.to_string()).collect();
        let prompts: Vec<Prompt> = lengths.iter().map(|&n| Prompt::Tokens(n)).collect();
        Plan::grid(
            &models,
            &prompts,
            &CellTemplate { max_tokens: 6, warmup_tokens: 1, named: Named { models: true, prompts: true } },
        )
    }

    #[test]
    fn one_array_per_model_shortest_prompt_first() {
        // A ladder typed out of order still runs each model's lengths in ascending order.
        let p = plan(&["a", "b"], &[512, 64, 128]);
        let arrs = arrays(&p, None);
        assert_eq!(arrs.len(), 2);
        assert_eq!(
            (arrs[0].model.as_str(), arrs[0].cells.clone(), arrs[0].after),
            ("a", vec![1, 2, 0], None)
        );
        assert_eq!(
            (arrs[1].model.as_str(), arrs[1].cells.clone(), arrs[1].after),
            ("b", vec![4, 5, 3], None)
        );
        let lens: Vec<u64> = arrs[1].cells.iter().map(|&i| p.cells[i].layer_len()).collect();
        assert_eq!(lens, [64, 128, 512]);
    }

    #[test]
    fn max_parallel_chains_arrays_into_lanes() {
        let p = plan(&["a", "b", "c", "d", "e"], &[16]);
        let after: Vec<Option<usize>> = arrays(&p, Some(2)).iter().map(|a| a.after).collect();
        assert_eq!(after, [None, None, Some(0), Some(1), Some(2)]);
        let after: Vec<Option<usize>> = arrays(&p, Some(1)).iter().map(|a| a.after).collect();
        assert_eq!(after, [None, Some(0), Some(1), Some(2), Some(3)]);
        assert!(arrays(&p, Some(9)).iter().all(|a| a.after.is_none()));
        assert!(arrays(&p, None).iter().all(|a| a.after.is_none()));
    }

    #[test]
    fn the_script_throttles_to_one_and_passes_every_option_through() {
        let p = plan(&["synthetic:tiny", "synthetic:tiny-qwen"], &[16, 32, 64]);
        let arrs = arrays(&p, Some(1));
        let opts = SbatchOptions {
            partition: Some("gpu".into()),
            account: Some("lab".into()),
            time: Some("00:10:00".into()),
            gres: Some("gpu:1".into()),
            extra: vec!["--mem=8G".into(), "--constraint=h100".into()],
        };
        let env: BTreeMap<String, String> =
            [("KILN_BENCH_FAKE_OOM".to_string(), "synthetic:tiny:16".to_string())].into();
        let run = Path::new("/shared/runs/x");
        let s = batch_script(run, "longprompt", 1, &arrs[1], &p, &opts, &env).unwrap();
        let want = "#!/bin/bash\n\
            #SBATCH --job-name=kiln-longprompt-2\n\
            #SBATCH --array=0-2%1\n\
            #SBATCH --output=/shared/runs/x/slurm/2-%A_%a.out\n\
            #SBATCH --ntasks=1\n\
            #SBATCH --partition=gpu\n\
            #SBATCH --account=lab\n\
            #SBATCH --time=00:10:00\n\
            #SBATCH --gres=gpu:1\n\
            #SBATCH --mem=8G\n\
            #SBATCH --constraint=h100\n\
            # kiln sweep /shared/runs/x: model synthetic:tiny-qwen, one task per cell, one at a time (%1), shortest prompt first:\n\
            # synthetic:tiny-qwen@16 synthetic:tiny-qwen@32 synthetic:tiny-qwen@64\n\
            set -eu\n\
            export KILN_BENCH_FAKE_OOM=synthetic:tiny:16\n\
            cells=(3 4 5)\n\
            exec /shared/runs/x/bin/xtask sweep-task /shared/runs/x \"${cells[$SLURM_ARRAY_TASK_ID]}\"\n";
        assert_eq!(s, want);
        // No options: only what the runner needs.
        let bare = batch_script(run, "decode", 0, &arrs[0], &p, &SbatchOptions::default(), &BTreeMap::new())
            .unwrap();
        assert!(!bare.contains("--partition") && !bare.contains("export "), "{bare}");
        // The dependency names the earlier array's job, or a placeholder in a dry run.
        let script = Path::new("/shared/runs/x/slurm/2.sbatch");
        assert_eq!(
            sbatch_args(&arrs[1], script, Some(&["41".to_string()])),
            ["--parsable", "--dependency=afterany:41", "/shared/runs/x/slurm/2.sbatch"]
        );
        assert_eq!(sbatch_args(&arrs[1], script, None)[1], "--dependency=afterany:$JOB_1");
        assert_eq!(sbatch_args(&arrs[0], script, None), ["--parsable", "/shared/runs/x/slurm/2.sbatch"]);
    }

    /// Runs `script` as Slurm would run task `task` of its array, with `bin/xtask` under
    /// `run` a printer of its arguments and its `KILN_*` environment; returns them.
    fn run_as_task(run: &Path, script: &str, task: usize) -> (Vec<String>, BTreeMap<String, String>) {
        let bin = run.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let printer = bin.join("xtask");
        let out = run.join("printed");
        std::fs::write(
            &printer,
            format!(
                "#!/bin/bash\nprintf '%s\\0' \"$@\" > {o}.args\nfor k in \"${{!KILN_@}}\"; do printf '%s=%s\\0' \"$k\" \"${{!k}}\"; done > {o}.env\n",
                o = shell::quote(&out.display().to_string())
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&printer, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = run.join("job.sbatch");
        std::fs::write(&path, script).unwrap();
        let check = std::process::Command::new("bash").arg("-n").arg(&path).output().unwrap();
        assert!(check.status.success(), "bash -n: {}\n{script}", String::from_utf8_lossy(&check.stderr));
        let st = std::process::Command::new("bash")
            .arg(&path)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap())
            .env("SLURM_ARRAY_TASK_ID", task.to_string())
            .current_dir(run)
            .status()
            .unwrap();
        assert!(st.success(), "{script}");
        let read = |ext: &str| {
            let t = std::fs::read_to_string(run.join(format!("printed.{ext}"))).unwrap();
            t.split_terminator('\0').map(str::to_string).collect::<Vec<_>>()
        };
        let env = read("env").into_iter().map(|kv| {
            let (k, v) = kv.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        });
        (read("args"), env.collect())
    }

    #[test]
    fn the_script_runs_only_its_own_commands_whatever_the_values() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let canary = dir.path().join("pwned");
        let c = canary.display().to_string();
        let p = plan(&["synthetic:tiny"], &[16, 32]);
        let arrs = arrays(&p, None);
        // Options without a control character stay on their #SBATCH line, whatever they hold.
        let opts = SbatchOptions {
            partition: Some(format!("gpu;touch {c}")),
            account: Some(format!("$(touch {c})")),
            time: Some(format!("`touch {c}`")),
            gres: Some("gpu:1 # x".into()),
            extra: vec![format!("--comment='a b' && touch {c}")],
        };
        let env: BTreeMap<String, String> = [
            ("KILN_A".to_string(), format!("x\ntouch {c}\n")),
            ("KILN_B".to_string(), format!("'; touch {c}; '")),
            ("KILN_C".to_string(), format!("$(touch {c}) `touch {c}` ${{HOME}} \\ \"")),
            ("KILN_D".to_string(), String::new()),
        ]
        .into();
        let s = batch_script(&run, "longprompt", 0, &arrs[0], &p, &opts, &env).unwrap();
        for line in s.lines().filter(|l| l.starts_with("#SBATCH")) {
            assert!(!line.contains('\n'));
        }
        let (args, got) = run_as_task(&run, &s, 1);
        assert_eq!(args, ["sweep-task".to_string(), run.display().to_string(), "1".into()]);
        assert_eq!(got, env, "the tasks see exactly the submitting KILN_* environment");
        assert!(!canary.exists(), "a value ran as a command:\n{s}");
    }

    #[test]
    fn a_value_or_name_that_would_add_a_line_or_a_command_is_refused() {
        let p = plan(&["synthetic:tiny"], &[16]);
        let arrs = arrays(&p, None);
        let run = Path::new("/shared/runs/x");
        let script = |opts: &SbatchOptions, env: &BTreeMap<String, String>| {
            batch_script(run, "decode", 0, &arrs[0], &p, opts, env).unwrap_err().to_string()
        };
        let none = BTreeMap::new();
        let e = script(
            &SbatchOptions { partition: Some("gpu\ntouch /tmp/x".into()), ..Default::default() },
            &none,
        );
        assert!(
            e.starts_with("--partition \"gpu\\ntouch /tmp/x\": holds the control character '\\n'"),
            "{e}"
        );
        let e = script(&SbatchOptions { extra: vec!["--mem=1G\rid".into()], ..Default::default() }, &none);
        assert!(e.starts_with("--sbatch-arg "), "{e}");
        for name in ["KILN_X;touch /tmp/x;Y", "KILN_X=1 touch", "KILN_$(id)"] {
            let env: BTreeMap<String, String> = [(name.to_string(), "1".to_string())].into();
            let e = script(&SbatchOptions::default(), &env);
            assert!(e.contains("is not a shell variable name") && e.contains(&format!("{name:?}")), "{e}");
        }
        let e = batch_script(
            Path::new("/shared/a\nb"),
            "decode",
            0,
            &arrs[0],
            &p,
            &SbatchOptions::default(),
            &none,
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("--shared-dir "), "{e}");
        // A model name only reaches the comment lines, its control characters masked.
        let odd = plan(&["m\rx"], &[16]);
        let s =
            batch_script(run, "decode", 0, &arrays(&odd, None)[0], &odd, &SbatchOptions::default(), &none)
                .unwrap();
        assert!(s.contains("model m?x,") && !s.contains('\r'), "{s}");
    }
}
