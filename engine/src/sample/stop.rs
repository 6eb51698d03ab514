//! Stopping: deciding per generated token whether a request is finished ([`StopChecker`]) and
//! why ([`FinishReason`], [`StopMatch`]).

use serde::{Deserialize, Serialize};

use super::SamplingParams;

/// Why a request stopped generating.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// `max_new_tokens` generated.
    Length,
    /// Prompt + generated tokens filled the context window.
    Context,
    /// The caller aborted the request (deadline passed, client gone).
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Context => "context",
            Self::Abort => "abort",
        }
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What caused a [`FinishReason::Stop`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopMatch {
    /// EOS token `token` was generated.
    Eos { token: u32 },
    /// `stop_strings[index]` (= `stop`) begins at byte `offset` of the generated text; callers
    /// return `&text[..offset]`.
    StopString { index: usize, stop: String, offset: usize },
}

/// Per-request finish detection. Call [`check`](Self::check) once per generated token with the
/// generated text so far (not the prompt, including this token's text; append-only apart from a
/// trailing partial character that a later token may complete).
///
/// Precedence when several hold on the same token: **Stop** (stop string, then EOS) before
/// **Length** before **Context**. Once finished, `check` keeps returning the same reason and counts
/// nothing.
#[derive(Debug, Clone)]
pub struct StopChecker {
    eos_ids: Vec<u32>,
    stop_strings: Vec<String>,
    ignore_eos: bool,
    max_new_tokens: usize,
    max_context_len: usize,
    prompt_len: usize,
    generated: usize,
    /// Text length at the previous check: only the tail since then (plus overlap) is searched.
    searched_len: usize,
    max_stop_len: usize,
    finished: Option<FinishReason>,
    stop_match: Option<StopMatch>,
}

impl StopChecker {
    pub fn new(eos_ids: Vec<u32>, params: &SamplingParams, max_context_len: usize, prompt_len: usize) -> Self {
        // Empty strings (rejected by `validate`) are kept for indexing but never searched.
        let stop_strings = params.stop_strings.clone();
        let max_stop_len = stop_strings.iter().map(String::len).max().unwrap_or(0);
        Self {
            eos_ids,
            stop_strings,
            ignore_eos: params.ignore_eos,
            max_new_tokens: params.max_new_tokens,
            max_context_len,
            prompt_len,
            generated: 0,
            searched_len: 0,
            max_stop_len,
            finished: None,
            stop_match: None,
        }
    }

    /// Records one generated `token`; `text_so_far` is the generated text including it.
    pub fn check(&mut self, token: u32, text_so_far: &str) -> Option<FinishReason> {
        if self.finished.is_some() {
            return self.finished;
        }
        self.generated += 1;
        let reason = if let Some(m) = self.find_stop_string(text_so_far) {
            self.stop_match = Some(m);
            Some(FinishReason::Stop)
        } else if !self.ignore_eos && self.eos_ids.contains(&token) {
            self.stop_match = Some(StopMatch::Eos { token });
            Some(FinishReason::Stop)
        } else if self.generated >= self.max_new_tokens {
            Some(FinishReason::Length)
        } else if self.prompt_len + self.generated >= self.max_context_len {
            Some(FinishReason::Context)
        } else {
            None
        };
        self.finished = reason;
        reason
    }

    /// Earliest stop-string occurrence (lowest index on equal offsets) that touches the new text.
    fn find_stop_string(&mut self, text: &str) -> Option<StopMatch> {
        if self.max_stop_len == 0 {
            return None;
        }
        // A new match must end after the previous length; back up by the longest stop string plus
        // a few bytes in case a trailing partial character was replaced.
        let mut start = if text.len() < self.searched_len {
            0
        } else {
            self.searched_len.saturating_sub(self.max_stop_len + 3)
        };
        while !text.is_char_boundary(start) {
            start -= 1;
        }
        self.searched_len = text.len();
        let hay = &text[start..];
        let (offset, index) = self
            .stop_strings
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .filter_map(|(index, s)| hay.find(s.as_str()).map(|o| (start + o, index)))
            .min()?;
        Some(StopMatch::StopString {
            index,
            stop: self.stop_strings[index].clone(),
            offset,
        })
    }

    /// What caused the `Stop`, if the request stopped for that reason.
    pub fn stop_match(&self) -> Option<&StopMatch> {
        self.stop_match.as_ref()
    }

    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    /// Tokens generated so far (counted by `check`).
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// How many more tokens may be generated before Length or Context applies.
    pub fn remaining(&self) -> usize {
        if self.finished.is_some() {
            return 0;
        }
        let by_length = self.max_new_tokens.saturating_sub(self.generated);
        let by_context = self.max_context_len.saturating_sub(self.prompt_len + self.generated);
        by_length.min(by_context)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checker(max_new: usize, stops: &[&str], ignore_eos: bool, ctx: usize, prompt: usize) -> StopChecker {
        let p = SamplingParams {
            max_new_tokens: max_new,
            stop_strings: stops.iter().map(|s| s.to_string()).collect(),
            ignore_eos,
            ..SamplingParams::greedy()
        };
        StopChecker::new(vec![2, 7], &p, ctx, prompt)
    }

    #[test]
    fn eos_stops_unless_ignore_eos() {
        let mut c = checker(10, &[], false, 100, 5);
        assert_eq!(c.check(11, "a"), None);
        assert_eq!(c.check(7, "a"), Some(FinishReason::Stop));
        assert_eq!(c.stop_match(), Some(&StopMatch::Eos { token: 7 }));
        assert_eq!(c.check(11, "a"), Some(FinishReason::Stop), "sticky once finished");
        assert_eq!(c.generated(), 2);

        let mut c = checker(3, &[], true, 100, 5);
        assert_eq!(c.check(2, ""), None);
        assert_eq!(c.check(7, ""), None);
        assert_eq!(c.check(2, ""), Some(FinishReason::Length));
    }

    #[test]
    fn stop_string_split_across_two_tokens_reports_its_offset() {
        let mut c = checker(10, &["###", "END"], false, 100, 5);
        assert_eq!(c.check(11, "Hello E"), None);
        assert_eq!(c.check(12, "Hello EN"), None);
        assert_eq!(c.check(13, "Hello END and"), Some(FinishReason::Stop));
        let m = c.stop_match().unwrap();
        assert_eq!(
            m,
            &StopMatch::StopString {
                index: 1,
                stop: "END".into(),
                offset: 6
            }
        );
        assert_eq!(&"Hello END and"[..6], "Hello ");
    }

    #[test]
    fn stop_string_earliest_match_wins_and_multibyte_text_is_safe() {
        let mut c = checker(10, &["b c", "é"], false, 100, 0);
        assert_eq!(c.check(1, "aaaaaaaé"), Some(FinishReason::Stop));
        assert_eq!(
            c.stop_match(),
            Some(&StopMatch::StopString {
                index: 1,
                stop: "é".into(),
                offset: 7
            })
        );
        let mut c = checker(10, &["xyz", "b c"], false, 100, 0);
        assert_eq!(c.check(1, "ééé"), None);
        assert_eq!(c.check(1, "éééa b cxyz"), Some(FinishReason::Stop));
        assert!(matches!(
            c.stop_match(),
            Some(StopMatch::StopString {
                index: 1,
                offset: 8,
                ..
            })
        ));
    }

    #[test]
    fn stop_string_fed_one_char_at_a_time_is_found() {
        let text = "lorem ipsum dolor <|stop|> amet";
        let mut c = checker(1000, &["<|stop|>"], false, 10_000, 0);
        let mut end = None;
        for i in 1..=text.len() {
            if c.check(0, &text[..i]).is_some() {
                end = Some(i);
                break;
            }
        }
        assert_eq!(end, Some(text.find("<|stop|>").unwrap() + 8));
        assert!(matches!(c.stop_match(), Some(StopMatch::StopString { offset: 18, .. })));
    }

    #[test]
    fn length_when_max_new_tokens_reached() {
        let mut c = checker(3, &[], false, 100, 5);
        assert_eq!(c.remaining(), 3);
        assert_eq!(c.check(1, "a"), None);
        assert_eq!(c.check(1, "aa"), None);
        assert_eq!(c.remaining(), 1);
        assert_eq!(c.check(1, "aaa"), Some(FinishReason::Length));
        assert_eq!((c.stop_match(), c.remaining()), (None, 0));
    }

    #[test]
    fn context_when_prompt_plus_generated_fills_the_window() {
        let mut c = checker(100, &[], false, 7, 5);
        assert_eq!(c.remaining(), 2);
        assert_eq!(c.check(1, "a"), None);
        assert_eq!(c.check(1, "aa"), Some(FinishReason::Context));
    }

    #[test]
    fn precedence_is_stop_then_length_then_context() {
        // Token 2 is EOS, and it is both the last allowed new token and the last context slot.
        let mut c = checker(2, &[], false, 7, 5);
        c.check(1, "a");
        assert_eq!(c.check(2, "a"), Some(FinishReason::Stop));
        // A stop string on that same token.
        let mut c = checker(2, &["ab"], false, 7, 5);
        c.check(1, "a");
        assert_eq!(c.check(1, "ab"), Some(FinishReason::Stop));
        assert!(matches!(c.stop_match(), Some(StopMatch::StopString { offset: 0, .. })));
        // Stop string and EOS together: the stop string is reported (it carries the cut).
        let mut c = checker(10, &["ab"], false, 100, 0);
        assert_eq!(c.check(7, "ab"), Some(FinishReason::Stop));
        assert!(matches!(c.stop_match(), Some(StopMatch::StopString { .. })));
        // Length and Context together.
        let mut c = checker(2, &[], false, 7, 5);
        c.check(1, "a");
        assert_eq!(c.check(1, "a"), Some(FinishReason::Length));
    }
}
