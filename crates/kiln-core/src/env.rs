//! Reading kiln-core's settings from the environment.

/// The value of the environment variable `name` for a setting whose parser reads an empty
/// value as its default: unset reads as empty, and a value that is not UTF-8 is the error
/// naming `name` and what is `accepted`.
pub(crate) fn setting_env(name: &str, accepted: &str) -> Result<String, String> {
    match std::env::var(name) {
        Ok(v) => Ok(v),
        Err(std::env::VarError::NotPresent) => Ok(String::new()),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(format!("invalid {name}: not UTF-8; accepted values are {accepted}"))
        }
    }
}
