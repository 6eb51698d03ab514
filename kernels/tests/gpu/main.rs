//! The kernels against their CPU twins (`nextn_engine`'s CPU math), one module per kernel family, all in one test
//! binary: every test binary embeds every kernel (~6 MB of fatbin), and the device check carries each binary to the
//! GPU machine under the device tool's 64 MiB limit (bench/gpu/build.sh). Run one family with
//! `cargo test -p nextn-kernels --features cuda --test gpu linear::`.
#![cfg(feature = "cuda")]

mod attention;
mod elementwise;
mod embedding;
mod gdn;
mod linear;
mod meta;
mod moe;
mod norm;
mod rope_kv;
mod sample;
mod timing;
