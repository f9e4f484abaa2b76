//! Turning a stream of sampled tokens into the text a client sees: incremental
//! detokenization that only releases whole characters, stop strings (generation ends at
//! the first one, which is not sent), and the split of reasoning (text between the think
//! tags, sent as `reasoning_content`) from the answer (`content`). Text that could still
//! become a stop string or a tag is held back until it is known not to.

/// Which field a piece of text belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    /// The answer (`content`, or a completion's `text`).
    Content,
    /// Text between the think tags (`reasoning_content`).
    Reasoning,
}

/// A run of text for one channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Where it goes.
    pub channel: Channel,
    /// The text.
    pub text: String,
}

/// The think tags, when reasoning is split out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThinkTags {
    /// Opens reasoning (`<think>`).
    pub open: String,
    /// Closes it (`</think>`).
    pub close: String,
}

impl Default for ThinkTags {
    fn default() -> Self {
        ThinkTags { open: "<think>".into(), close: "</think>".into() }
    }
}

/// Releases decoded text as it becomes final.
#[derive(Debug)]
pub struct Emitter {
    stops: Vec<String>,
    tags: Option<ThinkTags>,
    in_think: bool,
    pending: String,
    stopped: bool,
}

impl Emitter {
    /// An emitter ending at any of `stops` (empty strings are ignored) and splitting out
    /// reasoning when `tags` is given.
    pub fn new(stops: Vec<String>, tags: Option<ThinkTags>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Emitter { stops, tags, in_think: false, pending: String::new(), stopped: false }
    }

    /// Whether a stop string was seen; nothing more is released after it.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds newly decoded text; returns what is now final.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.stopped {
            return out;
        }
        self.pending.push_str(text);
        loop {
            let channel = self.channel();
            let stop = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min();
            let tag = self.next_tag().and_then(|t| self.pending.find(t.as_str()).map(|i| (i, t.len())));
            match (stop, tag) {
                (Some(s), t) if t.is_none_or(|(ti, _)| s <= ti) => {
                    emit(&mut out, channel, &self.pending[..s]);
                    self.pending.clear();
                    self.stopped = true;
                    return out;
                }
                (_, Some((ti, len))) => {
                    emit(&mut out, channel, &self.pending[..ti]);
                    self.pending.drain(..ti + len);
                    self.in_think = !self.in_think;
                }
                _ => {
                    let keep = self.held_back();
                    let cut = self.pending.len() - keep;
                    emit(&mut out, channel, &self.pending[..cut]);
                    self.pending.drain(..cut);
                    return out;
                }
            }
        }
    }

    /// The end of generation: releases whatever was held back.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if !self.stopped {
            emit(&mut out, self.channel(), &self.pending);
        }
        self.pending.clear();
        out
    }

    fn channel(&self) -> Channel {
        if self.in_think { Channel::Reasoning } else { Channel::Content }
    }

    fn next_tag(&self) -> Option<String> {
        self.tags.as_ref().map(|t| if self.in_think { t.close.clone() } else { t.open.clone() })
    }

    /// Bytes at the end of `pending` that are a proper prefix of a stop string or of the
    /// next tag, cut back to a character boundary.
    fn held_back(&self) -> usize {
        let p = &self.pending;
        let tag = self.next_tag();
        let mut keep = 0;
        for pat in self.stops.iter().map(String::as_str).chain(tag.as_deref()) {
            for n in (1..pat.len().min(p.len() + 1)).rev() {
                if n <= keep {
                    break;
                }
                if p.is_char_boundary(p.len() - n) && pat.is_char_boundary(n) && p.ends_with(&pat[..n]) {
                    keep = n;
                    break;
                }
            }
        }
        keep
    }
}

fn emit(out: &mut Vec<Piece>, channel: Channel, text: &str) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(last) if last.channel == channel => last.text.push_str(text),
        _ => out.push(Piece { channel, text: text.to_string() }),
    }
}

/// Decoded text so far, released only as whole characters (a byte-level token can end
/// inside a UTF-8 sequence, which decodes to U+FFFD until the rest arrives).
#[derive(Debug, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    sent: usize,
}

impl Detokenizer {
    /// Adds `token`; `decode` turns all ids so far into text. Returns the new text, empty
    /// while a character is incomplete.
    pub fn push<E>(&mut self, token: u32, decode: impl Fn(&[u32]) -> Result<String, E>) -> Result<String, E> {
        self.ids.push(token);
        let text = decode(&self.ids)?;
        if text.ends_with('\u{fffd}') {
            return Ok(String::new());
        }
        Ok(self.take_new(text))
    }

    /// The end of generation: whatever is left, an incomplete character included.
    pub fn finish<E>(&mut self, decode: impl Fn(&[u32]) -> Result<String, E>) -> Result<String, E> {
        let text = decode(&self.ids)?;
        Ok(self.take_new(text))
    }

    fn take_new(&mut self, text: String) -> String {
        match text.get(self.sent..) {
            Some(new) => {
                let new = new.to_string();
                self.sent = text.len();
                new
            }
            // A tokenizer whose decode is not prefix-stable: send nothing rather than
            // repeat or cut text.
            None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content(pieces: &[Piece]) -> String {
        pieces.iter().filter(|p| p.channel == Channel::Content).map(|p| p.text.as_str()).collect()
    }

    fn reasoning(pieces: &[Piece]) -> String {
        pieces.iter().filter(|p| p.channel == Channel::Reasoning).map(|p| p.text.as_str()).collect()
    }

    fn feed(e: &mut Emitter, parts: &[&str]) -> Vec<Piece> {
        let mut all = Vec::new();
        for p in parts {
            all.extend(e.push(p));
        }
        all.extend(e.finish());
        all
    }

    #[test]
    fn a_stop_string_split_across_tokens_ends_the_text_before_it() {
        let mut e = Emitter::new(vec!["END".into()], None);
        let out = feed(&mut e, &["hello E", "N", "D more"]);
        assert_eq!(content(&out), "hello ");
        assert!(e.stopped());
    }

    #[test]
    fn a_near_miss_is_released() {
        let mut e = Emitter::new(vec!["END".into()], None);
        let first = e.push("abc EN");
        assert_eq!(content(&first), "abc ");
        let out = feed(&mut e, &["X"]);
        assert_eq!(content(&out), "ENX");
        assert!(!e.stopped());
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        let mut e = Emitter::new(vec!["zz".into(), "b".into(), String::new()], None);
        assert_eq!(content(&feed(&mut e, &["aabzz"])), "aa");
    }

    #[test]
    fn think_tags_split_reasoning_from_content() {
        let mut e = Emitter::new(vec![], Some(ThinkTags::default()));
        let out = feed(&mut e, &["<thi", "nk>step one", " two</th", "ink>answer"]);
        assert_eq!(reasoning(&out), "step one two");
        assert_eq!(content(&out), "answer");
    }

    #[test]
    fn a_stop_inside_reasoning_ends_everything() {
        let mut e = Emitter::new(vec!["STOP".into()], Some(ThinkTags::default()));
        let out = feed(&mut e, &["a<think>b STOP c</think>d"]);
        assert_eq!(content(&out), "a");
        assert_eq!(reasoning(&out), "b ");
    }

    #[test]
    fn multibyte_text_is_never_cut_inside_a_character() {
        let mut e = Emitter::new(vec!["é!".into()], None);
        let out = feed(&mut e, &["café", " ok"]);
        assert_eq!(content(&out), "café ok");
    }

    #[test]
    fn the_detokenizer_waits_for_whole_characters() {
        let decode = |ids: &[u32]| -> Result<String, ()> {
            let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        };
        let mut d = Detokenizer::default();
        let e_acute = "é".as_bytes();
        assert_eq!(d.push(u32::from(b'a'), decode).unwrap(), "a");
        assert_eq!(d.push(u32::from(e_acute[0]), decode).unwrap(), "");
        assert_eq!(d.push(u32::from(e_acute[1]), decode).unwrap(), "é");
        assert_eq!(d.push(0xff, decode).unwrap(), "");
        assert_eq!(d.finish(decode).unwrap(), "\u{fffd}");
    }
}
