//! GPU clocks, power, temperature and memory from NVML (feature `nvml`), as one JSON value. Missing
//! library or device: a JSON object saying why, never a panic.

use serde_json::{json, Value};

#[cfg(feature = "nvml")]
pub fn snapshot(index: u32) -> Value {
    use nvml_wrapper::Nvml;
    use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(e) => return json!({"nvml": format!("unavailable: {e}")}),
    };
    let d = match nvml.device_by_index(index) {
        Ok(d) => d,
        Err(e) => return json!({"nvml": format!("device {index}: {e}")}),
    };
    let mem = d.memory_info().ok();
    json!({
        "name": d.name().ok(),
        "sm_clock_mhz": d.clock_info(Clock::SM).ok(),
        "mem_clock_mhz": d.clock_info(Clock::Memory).ok(),
        "max_sm_clock_mhz": d.max_clock_info(Clock::SM).ok(),
        "power_w": d.power_usage().ok().map(|mw| mw as f64 / 1e3),
        "power_limit_w": d.enforced_power_limit().ok().map(|mw| mw as f64 / 1e3),
        "temperature_c": d.temperature(TemperatureSensor::Gpu).ok(),
        "memory_used_gib": mem.as_ref().map(|m| m.used as f64 / (1u64 << 30) as f64),
        "memory_total_gib": mem.as_ref().map(|m| m.total as f64 / (1u64 << 30) as f64),
    })
}

#[cfg(not(feature = "nvml"))]
pub fn snapshot(_index: u32) -> Value {
    json!({"nvml": "not built (feature nvml)"})
}
