//! Caches: which KV blocks and GDN state slots belong to whom ([`blocks`], [`slots`]), the prefix cache that
//! shares them between requests ([`prefix`]), and the host storage behind them ([`storage`]).

pub mod blocks;
pub mod prefix;
pub mod slots;
pub mod storage;
