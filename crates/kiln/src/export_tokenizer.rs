//! `kiln export-tokenizer MODEL DIR`: writes the model's tokenizer as the Hugging Face
//! files client-side tools load (`tokenizer.json`, `tokenizer_config.json`; kiln-model's
//! `tokenizer_files` says what they hold), each to a temporary name in DIR and then
//! renamed into place, and says on stdout what it wrote. No weights are loaded.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use kiln_model::tokenizer_files;

use crate::exit::usage;

/// `kiln export-tokenizer`.
#[derive(Args, Debug)]
pub struct ExportTokenizerArgs {
    /// The model whose tokenizer to write.
    #[arg(value_name = "MODEL", help = crate::args::MODEL_HELP)]
    pub model: String,
    /// The directory to write into (created if missing; the two files are replaced if
    /// present, other files are left alone).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

/// Runs the command.
pub fn run(args: ExportTokenizerArgs) -> anyhow::Result<()> {
    let exists = match std::fs::metadata(&args.dir) {
        Ok(m) if m.is_dir() => true,
        Ok(_) => {
            return Err(usage(format!(
                "invalid DIR {}: it exists and is not a directory; name a directory or a new path",
                args.dir.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        // A path under a file, or through a looping link: no directory can be made there.
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory || e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(usage(format!(
                "invalid DIR {}: {e}; name a directory or a new path whose parent is a directory",
                args.dir.display()
            )));
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", args.dir.display())),
    };
    let model =
        kiln_model::load_text(&args.model).with_context(|| format!("loading model {}", args.model))?;
    let json = tokenizer_files::tokenizer_json(&model)
        .with_context(|| format!("writing the tokenizer of {}", args.model))?;
    let config = tokenizer_files::tokenizer_config(&model)
        .with_context(|| format!("writing the tokenizer config of {}", args.model))?;
    let plain_template = model.chat_template.is_none() && config["chat_template"].is_string();
    let config = serde_json::to_string_pretty(&config).context("serializing tokenizer_config.json")?;
    let files = [("tokenizer.json", json), ("tokenizer_config.json", config)];
    // Both targets are checked before either is written.
    for (name, _) in &files {
        refuse_unless_regular(&args.dir.join(name))?;
    }
    if !exists {
        // Only once there is something to write: a model that does not load leaves no DIR.
        std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    }
    let mut out = std::io::stdout().lock();
    for (name, text) in files {
        let path = args.dir.join(name);
        write_atomically(&path, text.as_bytes())?;
        writeln!(out, "wrote {} ({} bytes)", path.display(), text.len()).context("writing to stdout")?;
    }
    if plain_template {
        writeln!(out, "chat template: the plain rendering kiln serve uses for a model without one")
            .context("writing to stdout")?;
    } else if model.chat_template.is_none() {
        writeln!(out, "chat template: none (the tokenizer adds special tokens after the text)")
            .context("writing to stdout")?;
    }
    Ok(())
}

/// Refuses a `path` that exists as anything but a regular file (a FIFO, a link, a
/// directory), which a rename would replace.
fn refuse_unless_regular(path: &Path) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.is_file() => Err(usage(format!(
            "cannot write {}: it exists and is not a regular file; move it away or choose another DIR",
            path.display()
        ))),
        _ => Ok(()),
    }
}

/// Writes `bytes` to a temporary file beside `path` and renames it over `path`, so a
/// reader sees the old file or the whole new one.
fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(())
}
