//! The pieces of a self-contained HTML page: escaping, tables, the stylesheet, and the
//! small part of markdown the harness writes (headings, tables, lists, code, paragraphs).

use std::fmt::Write as _;

pub use crate::plot::escape;
use crate::verdict::sheet::Sheet;

/// The page's stylesheet, inline: no network, no scripts.
pub const CSS: &str = "body{font-family:DejaVu Sans,Verdana,Arial,sans-serif;margin:24px;color:#222;max-width:1800px}\
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}h3{font-size:15px}\
table{border-collapse:collapse;margin:8px 0;font-size:13px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}\
th{background:#f2f2f2}td.n{text-align:right;font-variant-numeric:tabular-nums}\
code,pre{font-family:DejaVu Sans Mono,monospace;font-size:12px}pre{background:#f6f6f6;padding:8px;overflow-x:auto;white-space:pre-wrap}\
.bad{color:#b00020}.good{color:#006d2c}.plot{overflow-x:auto}.note{color:#555;font-size:13px}\
.headline{font-size:15px}ul.notes{font-size:13px}";

/// The pages' Content-Security-Policy: inline style and `data:` images, nothing else; no
/// script, no form may submit anywhere, no `<base>` may move the links, no frame.
/// (`frame-ancestors` cannot be set from a meta tag.)
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'none'; base-uri 'none'; frame-src 'none'";

/// The page's head and title.
pub fn head(title: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">\
<title>{}</title><style>{CSS}</style></head><body>\n<h1>{}</h1>\n",
        escape(title),
        escape(title)
    )
}

/// A table; `numeric[i]` right-aligns column i. Every cell is escaped.
pub fn table(headers: &[&str], rows: &[Vec<String>], numeric: &[bool]) -> String {
    table_with(headers, rows, numeric, escape)
}

/// [`table`] with every cell written by `cell` (escaped text, or [`inline`]'s code spans).
fn table_with(headers: &[&str], rows: &[Vec<String>], numeric: &[bool], cell: fn(&str) -> String) -> String {
    let mut s = String::from("<table><tr>");
    for h in headers {
        let _ = write!(s, "<th>{}</th>", escape(h));
    }
    s.push_str("</tr>\n");
    for r in rows {
        s.push_str("<tr>");
        for (i, c) in r.iter().enumerate() {
            let class = if numeric.get(i).copied().unwrap_or(false) { " class=\"n\"" } else { "" };
            let _ = write!(s, "<td{class}>{}</td>", cell(c));
        }
        s.push_str("</tr>\n");
    }
    s.push_str("</table>\n");
    s
}

/// A run's [`Sheet`] as HTML: its headline, each table with its legend (a number's cell
/// right-aligned), and its notes. Every text is the cell's own, escaped: the page prints
/// what the terminal printed.
pub fn sheet(sheet: &Sheet) -> String {
    let mut s = String::new();
    for line in sheet.headline.lines().filter(|l| !l.trim().is_empty()) {
        let _ = writeln!(s, "<p class=\"headline\"><strong>{}</strong></p>", escape(line));
    }
    for t in &sheet.tables {
        if !t.title.is_empty() {
            let _ = writeln!(s, "<h3>{}</h3>", escape(&t.title));
        }
        let headers: Vec<&str> = t.columns.iter().map(String::as_str).collect();
        let body: Vec<Vec<String>> =
            t.rows.iter().map(|r| r.iter().map(|c| c.text.clone()).collect()).collect();
        let numeric: Vec<bool> = (0..t.columns.len())
            .map(|i| t.rows.iter().any(|r| r.get(i).is_some_and(|c| c.numeric())))
            .collect();
        // A cell's `code` spans (a benchmark id, a cell's phase) are code on the page too.
        s.push_str(&table_with(&headers, &body, &numeric, inline));
        if !t.legend.is_empty() {
            let _ = writeln!(s, "<p class=\"note\">{}</p>", inline(&t.legend));
        }
    }
    if !sheet.notes.is_empty() {
        s.push_str("<ul class=\"notes\">");
        for n in &sheet.notes {
            let _ = write!(s, "<li>{}</li>", inline(n));
        }
        s.push_str("</ul>\n");
    }
    s
}

fn inline(text: &str) -> String {
    // `code` spans, everything else as text.
    let mut out = String::new();
    for (i, part) in text.split('`').enumerate() {
        if i % 2 == 1 {
            let _ = write!(out, "<code>{}</code>", escape(part));
        } else {
            out.push_str(&escape(part));
        }
    }
    out
}

fn cells(line: &str) -> Vec<String> {
    let t = line.trim().trim_start_matches('|').trim_end_matches('|');
    t.split('|').map(|c| c.trim().to_string()).collect()
}

/// Markdown as the harness writes it, to HTML; anything it does not know is a paragraph.
pub fn markdown(md: &str) -> String {
    let mut out = String::new();
    let lines: Vec<&str> = md.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i];
        let t = l.trim();
        if t.starts_with("```") {
            let mut code = Vec::new();
            i += 1;
            while i < lines.len() && !lines[i].trim().starts_with("```") {
                code.push(lines[i]);
                i += 1;
            }
            let _ = writeln!(out, "<pre>{}</pre>", escape(&code.join("\n")));
        } else if t.starts_with('|') {
            let mut rows = Vec::new();
            while i < lines.len() && lines[i].trim().starts_with('|') {
                let r = cells(lines[i]);
                if !r.iter().all(|c| !c.is_empty() && c.chars().all(|ch| matches!(ch, '-' | ':' | ' '))) {
                    rows.push(r);
                }
                i += 1;
            }
            let mut s = String::from("<table>");
            for (k, r) in rows.iter().enumerate() {
                let tag = if k == 0 { "th" } else { "td" };
                s.push_str("<tr>");
                for c in r {
                    let _ = write!(s, "<{tag}>{}</{tag}>", inline(c));
                }
                s.push_str("</tr>\n");
            }
            s.push_str("</table>\n");
            out.push_str(&s);
            continue;
        } else if let Some(h) = t.strip_prefix('#') {
            let level = 1 + h.chars().take_while(|c| *c == '#').count();
            let level = (level + 1).min(6);
            let _ = writeln!(out, "<h{level}>{}</h{level}>", inline(h.trim_start_matches('#').trim()));
        } else if let Some(item) = t.strip_prefix("- ") {
            let mut items = vec![item.to_string()];
            i += 1;
            while i < lines.len() && lines[i].trim().starts_with("- ") {
                items.push(lines[i].trim()[2..].to_string());
                i += 1;
            }
            out.push_str("<ul>");
            for it in items {
                let _ = write!(out, "<li>{}</li>", inline(&it));
            }
            out.push_str("</ul>\n");
            continue;
        } else if !t.is_empty() {
            let _ = writeln!(out, "<p>{}</p>", inline(t));
        }
        i += 1;
    }
    out
}

/// An SVG file the harness did not draw in this process, as an image: `<img>` with the
/// file in a `data:` address. A browser draws an SVG image without running its scripts,
/// submitting its forms or following its links, so nothing in the file becomes markup of
/// the page (pasting it inline, even after a filter, would).
pub fn svg_image(svg: &[u8], alt: &str) -> String {
    format!("<img alt=\"{}\" src=\"data:image/svg+xml;base64,{}\">", escape(alt), base64(svg))
}

/// Standard base64 (RFC 4648, with padding).
pub fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            out.push(if i <= chunk.len() { ABC[(n >> shift) as usize & 63] as char } else { '=' });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_tables_headings_and_code_become_html_with_the_text_escaped() {
        let md = "# Title <x>\n\n| a | b |\n|---|---:|\n| `1` | <b>2</b> |\n\n- one\n- two & three\n\n```\nx < y\n```\nplain";
        let h = markdown(md);
        assert!(h.contains("<h2>Title &lt;x&gt;</h2>"), "{h}");
        assert!(h.contains("<tr><th>a</th><th>b</th></tr>"), "{h}");
        assert!(h.contains("<td><code>1</code></td><td>&lt;b&gt;2&lt;/b&gt;</td>"), "{h}");
        assert!(
            h.contains("<li>two &amp; three</li>")
                && h.contains("<pre>x &lt; y</pre>")
                && h.contains("<p>plain</p>")
        );
    }

    #[test]
    fn base64_matches_the_rfc_4648_examples() {
        for (plain, coded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), coded, "{plain}");
        }
    }
}
