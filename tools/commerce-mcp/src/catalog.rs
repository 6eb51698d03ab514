//! The commerce fixture (products, stock, promotions, policies, live-room status) and the queries
//! behind each MCP tool. Queries return `Ok(json)` for a result and `Err(message)` for a caller
//! mistake (unknown product, colour, size, region...), which the server turns into an
//! `isError: true` tool result rather than a protocol error.

use std::path::{Path, PathBuf};

use chrono::{DateTime, FixedOffset, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The bundled fixture, `tools/commerce-mcp/data/catalog.json`: found through the crate's source
/// directory recorded at build time, or else relative to the working directory (workspace root).
pub fn default_data_path() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join("catalog.json");
    let relative = Path::new("tools")
        .join("commerce-mcp")
        .join("data")
        .join("catalog.json");
    if !built.exists() && relative.exists() {
        relative
    } else {
        built
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("invalid catalog: {0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Catalog {
    /// "Now" for promotion expiry; `None` reads the system clock at each query (see [`Catalog::with_now`]).
    #[serde(skip)]
    pub now: Option<DateTime<FixedOffset>>,
    pub currency: String,
    pub products: Vec<Product>,
    pub stock: Vec<StockEntry>,
    pub promotions: Vec<Promotion>,
    pub shipping: ShippingPolicy,
    pub after_sales: Value,
    pub room: RoomStatus,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Product {
    pub id: String,
    /// The id the avatar front end uses to pin the product's shop link (`show_product` actions).
    pub link_id: String,
    pub name: String,
    pub category: String,
    pub price: f64,
    pub currency: String,
    pub colours: Vec<String>,
    pub sizes: Vec<String>,
    pub material: String,
    pub description: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StockEntry {
    pub product_id: String,
    pub colour: String,
    pub size: String,
    pub quantity: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Promotion {
    pub code: String,
    pub title: String,
    pub description: String,
    /// `{"type": "percent" | "amount", "value": number}`.
    pub discount: Discount,
    /// Empty lists on both sides mean storewide.
    pub applies_to: AppliesTo,
    pub min_spend: Option<f64>,
    pub conditions: String,
    pub valid_until: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Discount {
    #[serde(rename = "type")]
    pub kind: DiscountKind,
    pub value: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscountKind {
    Percent,
    Amount,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AppliesTo {
    #[serde(default)]
    pub product_ids: Vec<String>,
    #[serde(default)]
    pub categories: Vec<String>,
}

impl AppliesTo {
    pub fn is_storewide(&self) -> bool {
        self.product_ids.is_empty() && self.categories.is_empty()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShippingPolicy {
    pub carrier: String,
    pub dispatch: String,
    pub regions: Vec<ShippingRegion>,
    #[serde(default)]
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShippingRegion {
    pub region: String,
    #[serde(default)]
    pub aliases: Vec<String>,
    pub fee: f64,
    pub free_over: Option<f64>,
    pub delivery_days: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoomStatus {
    pub title: String,
    pub host: String,
    pub live: bool,
    pub started_at: String,
    pub viewers: u64,
    #[serde(default)]
    pub likes: u64,
    pub current_product_id: Option<String>,
    pub ongoing_promotion: Option<String>,
    #[serde(default)]
    pub up_next: Vec<String>,
    #[serde(default)]
    pub announcement: Option<String>,
}

/// Stock at or below this is reported as "low stock".
pub const LOW_STOCK: u32 = 5;
/// `search_products` returns at most this many results, whatever `max_results` says.
pub const MAX_SEARCH_RESULTS: usize = 20;

fn norm(s: &str) -> String {
    s.trim().to_lowercase()
}

fn eq_ci(a: &str, b: &str) -> bool {
    norm(a) == norm(b)
}

impl Catalog {
    pub fn load(path: &Path) -> Result<Self, CatalogError> {
        let text = std::fs::read_to_string(path).map_err(|source| CatalogError::Read {
            path: path.to_owned(),
            source,
        })?;
        let catalog: Catalog =
            serde_json::from_str(&text).map_err(|source| CatalogError::Parse {
                path: path.to_owned(),
                source,
            })?;
        catalog.validate()?;
        Ok(catalog)
    }

    /// Cross-references: stock, promotions and the room only name products, colours and sizes
    /// that exist; ids and codes are unique.
    pub fn validate(&self) -> Result<(), CatalogError> {
        let bad = |m: String| Err(CatalogError::Invalid(m));
        let mut ids = std::collections::HashSet::new();
        for p in &self.products {
            if !ids.insert(p.id.as_str()) {
                return bad(format!("duplicate product id {}", p.id));
            }
            if p.colours.is_empty() || p.sizes.is_empty() {
                return bad(format!("product {} has no colours or no sizes", p.id));
            }
            if p.link_id.trim().is_empty() {
                return bad(format!("product {} has an empty link_id", p.id));
            }
        }
        let mut keys = std::collections::HashSet::new();
        for s in &self.stock {
            let Some(p) = self.product(&s.product_id) else {
                return bad(format!("stock names unknown product {}", s.product_id));
            };
            if !p.colours.iter().any(|c| c == &s.colour) || !p.sizes.iter().any(|z| z == &s.size) {
                return bad(format!(
                    "stock names {} / {} which {} does not come in",
                    s.colour, s.size, p.id
                ));
            }
            if !keys.insert((s.product_id.as_str(), s.colour.as_str(), s.size.as_str())) {
                return bad(format!(
                    "duplicate stock entry {} {} {}",
                    s.product_id, s.colour, s.size
                ));
            }
        }
        let mut codes = std::collections::HashSet::new();
        for promo in &self.promotions {
            if !codes.insert(norm(&promo.code)) {
                return bad(format!("duplicate promotion code {}", promo.code));
            }
            if let Err(e) = DateTime::parse_from_rfc3339(&promo.valid_until) {
                return bad(format!(
                    "promotion {}: valid_until '{}' is not an RFC 3339 time ({e})",
                    promo.code, promo.valid_until
                ));
            }
            for id in &promo.applies_to.product_ids {
                if self.product(id).is_none() {
                    return bad(format!(
                        "promotion {} names unknown product {id}",
                        promo.code
                    ));
                }
            }
        }
        if let Some(id) = &self.room.current_product_id
            && self.product(id).is_none()
        {
            return bad(format!("room shows unknown product {id}"));
        }
        if let Some(code) = &self.room.ongoing_promotion
            && self.promotion(code).is_none()
        {
            return bad(format!("room runs unknown promotion {code}"));
        }
        for id in &self.room.up_next {
            if self.product(id).is_none() {
                return bad(format!("room lists unknown product {id} up next"));
            }
        }
        Ok(())
    }

    /// Look a product up by id (case-insensitive) or by exact name (case-insensitive).
    pub fn product(&self, id_or_name: &str) -> Option<&Product> {
        self.products
            .iter()
            .find(|p| eq_ci(&p.id, id_or_name))
            .or_else(|| self.products.iter().find(|p| eq_ci(&p.name, id_or_name)))
    }

    pub fn promotion(&self, code: &str) -> Option<&Promotion> {
        self.promotions.iter().find(|p| eq_ci(&p.code, code))
    }

    /// Pin "now" (for `--now` / `COMMERCE_NOW` and tests); promotions whose `valid_until` is before it are
    /// not listed anywhere.
    pub fn with_now(mut self, now: DateTime<FixedOffset>) -> Self {
        self.now = Some(now);
        self
    }

    /// Parse an RFC 3339 time such as `2026-12-01T10:00:00+08:00`.
    pub fn parse_now(text: &str) -> Result<DateTime<FixedOffset>, String> {
        DateTime::parse_from_rfc3339(text.trim()).map_err(|e| {
            format!("'{text}' is not an RFC 3339 time such as 2026-12-01T10:00:00+08:00: {e}")
        })
    }

    /// Whether `promo` is still running now. `valid_until` is checked at load, so a parse failure here cannot
    /// happen for a validated catalog; it counts as expired rather than advertising a promotion of unknown end.
    pub fn is_running(&self, promo: &Promotion) -> bool {
        let now = self.now.unwrap_or_else(|| Utc::now().fixed_offset());
        DateTime::parse_from_rfc3339(&promo.valid_until).is_ok_and(|end| now <= end)
    }

    /// The promotions running now, in fixture order.
    fn running(&self) -> impl Iterator<Item = &Promotion> {
        self.promotions.iter().filter(|p| self.is_running(p))
    }

    fn unknown_product(&self, id: &str) -> String {
        let known: Vec<String> = self
            .products
            .iter()
            .map(|p| format!("{} ({})", p.id, p.name))
            .collect();
        format!(
            "Unknown product '{id}'. Use search_products to find a product id. Known products: {}.",
            known.join(", ")
        )
    }

    fn summary(p: &Product) -> Value {
        json!({
            "id": p.id, "link_id": p.link_id, "name": p.name, "category": p.category, "price": p.price,
            "currency": p.currency, "colours": p.colours, "sizes": p.sizes,
        })
    }

    fn stock_total(&self, id: &str) -> u32 {
        self.stock
            .iter()
            .filter(|s| s.product_id == id)
            .map(|s| s.quantity)
            .sum()
    }

    /// `search_products`: every query word must appear in the product's name, category, colours,
    /// material or description (case-insensitive); name hits rank first.
    pub fn search_products(&self, query: &str, max_results: Option<u32>) -> Result<Value, String> {
        let words: Vec<String> = query
            .split(|c: char| !c.is_alphanumeric() && c != '-')
            .filter(|w| !w.is_empty())
            .map(norm)
            .collect();
        if words.is_empty() {
            return Err(
                "The query is empty: give a few words such as 'jacket', 'black tee' or 'merino'."
                    .into(),
            );
        }
        let limit = match max_results {
            Some(0) => return Err("max_results must be at least 1.".into()),
            Some(n) => (n as usize).min(MAX_SEARCH_RESULTS),
            None => 5,
        };
        let mut scored: Vec<(u32, &Product)> = self
            .products
            .iter()
            .filter_map(|p| {
                let name = norm(&p.name);
                let id = norm(&p.id);
                let rest = norm(&format!(
                    "{} {} {} {}",
                    p.category,
                    p.colours.join(" "),
                    p.material,
                    p.description
                ));
                let mut score = 0;
                for w in &words {
                    // "jeans" should find "Jeans", and "jacket" "Jacket"; "tees" should find "Tee".
                    let stem = w.strip_suffix('s').filter(|s| s.len() >= 3).unwrap_or(w);
                    if id == *w || name.contains(stem) {
                        score += 3;
                    } else if rest.contains(stem) {
                        score += 1;
                    } else {
                        return None;
                    }
                }
                Some((score, p))
            })
            .collect();
        scored.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.id.cmp(&b.1.id)));
        let total = scored.len();
        let results: Vec<Value> = scored
            .into_iter()
            .take(limit)
            .map(|(_, p)| {
                let mut v = Self::summary(p);
                v["in_stock"] = json!(self.stock_total(&p.id) > 0);
                v
            })
            .collect();
        Ok(json!({ "query": query, "total_matches": total, "results": results }))
    }

    /// `get_product`: full details, total stock and the promotions that apply; with `fields` (names
    /// separated by commas, e.g. "price,material") only those, beside the id and name.
    pub fn get_product_fields(&self, product_id: &str, fields: Option<&str>) -> Result<Value, String> {
        let v = self.get_product(product_id)?;
        select_fields(v, fields, &["id", "name"], "get_product")
    }

    /// `get_product` with every field.
    pub fn get_product(&self, product_id: &str) -> Result<Value, String> {
        let p = self
            .product(product_id)
            .ok_or_else(|| self.unknown_product(product_id))?;
        let mut v = serde_json::to_value(p).expect("product serialises");
        v["total_stock"] = json!(self.stock_total(&p.id));
        v["promotion_codes"] = json!(
            self.promotions_for(p)
                .map(|x| x.code.as_str())
                .collect::<Vec<_>>()
        );
        v["on_screen_now"] = json!(self.room.current_product_id.as_deref() == Some(p.id.as_str()));
        Ok(v)
    }

    /// `check_stock`: quantities by colour and size, optionally filtered.
    pub fn check_stock(
        &self,
        product_id: &str,
        colour: Option<&str>,
        size: Option<&str>,
    ) -> Result<Value, String> {
        let p = self
            .product(product_id)
            .ok_or_else(|| self.unknown_product(product_id))?;
        let colour = colour.map(str::trim).filter(|c| !c.is_empty());
        let size = size.map(str::trim).filter(|s| !s.is_empty());
        if let Some(c) = colour
            && !p.colours.iter().any(|x| eq_ci(x, c))
        {
            return Err(format!(
                "{} ({}) does not come in colour '{c}'. Available colours: {}.",
                p.name,
                p.id,
                p.colours.join(", ")
            ));
        }
        if let Some(s) = size
            && !p.sizes.iter().any(|x| eq_ci(x, s))
        {
            return Err(format!(
                "{} ({}) does not come in size '{s}'. Available sizes: {}.",
                p.name,
                p.id,
                p.sizes.join(", ")
            ));
        }
        let entries: Vec<Value> = self
            .stock
            .iter()
            .filter(|e| e.product_id == p.id)
            .filter(|e| colour.is_none_or(|c| eq_ci(&e.colour, c)))
            .filter(|e| size.is_none_or(|s| eq_ci(&e.size, s)))
            .map(|e| {
                let status = match e.quantity {
                    0 => "sold out",
                    q if q <= LOW_STOCK => "low stock",
                    _ => "in stock",
                };
                json!({ "colour": e.colour, "size": e.size, "quantity": e.quantity, "status": status })
            })
            .collect();
        let total: u64 = entries
            .iter()
            .map(|e| e["quantity"].as_u64().unwrap_or(0))
            .sum();
        Ok(json!({
            "product_id": p.id,
            "name": p.name,
            "colour": colour,
            "size": size,
            "total_quantity": total,
            "available": total > 0,
            "variants": entries,
        }))
    }

    fn promotions_for<'a>(&'a self, p: &'a Product) -> impl Iterator<Item = &'a Promotion> + 'a {
        self.running().filter(move |promo| Self::applies_to(promo, p))
    }

    /// Whether `promo` applies to `p` (storewide, by id or by category), running or not.
    fn applies_to(promo: &Promotion, p: &Product) -> bool {
        let a = &promo.applies_to;
        a.is_storewide() || a.product_ids.iter().any(|id| id == &p.id) || a.categories.iter().any(|c| eq_ci(c, &p.category))
    }

    /// `list_promotions` with `code` and `fields`. A code selects that one promotion whether or not it is still
    /// running (so "is FLASH100 still on?" gets its `valid_until` and `"running": false`, not an empty list);
    /// with a product id too, the list is empty when the code does not apply to it. An unknown code is an
    /// error listing the codes running now. `fields` narrows each entry to those keys (code and running stay).
    pub fn list_promotions_narrowed(&self, product_id: Option<&str>, code: Option<&str>, fields: Option<&str>) -> Result<Value, String> {
        let product = match product_id.map(str::trim).filter(|s| !s.is_empty()) {
            Some(id) => Some(self.product(id).ok_or_else(|| self.unknown_product(id))?),
            None => None,
        };
        let for_product = |promo: &Promotion| product.is_none_or(|p| Self::applies_to(promo, p));
        let promos: Vec<&Promotion> = match code.map(str::trim).filter(|c| !c.is_empty()) {
            None => self.running().filter(|promo| for_product(promo)).collect(),
            Some(code) => {
                let promo = self.promotion(code).ok_or_else(|| {
                    let running: Vec<&str> = self.running().map(|p| p.code.as_str()).collect();
                    format!("list_promotions: no promotion code '{code}'. Codes running now: {}.", running.join(", "))
                })?;
                std::iter::once(promo).filter(|promo| for_product(promo)).collect()
            }
        };
        let promotions = promos
            .into_iter()
            .map(|promo| select_fields(self.promotion_entry(promo), fields, &["code", "running"], "list_promotions"))
            .collect::<Result<Vec<Value>, String>>()?;
        let product = product.map_or(Value::Null, |p| json!({ "id": p.id, "name": p.name }));
        Ok(json!({ "product": product, "currency": self.currency, "promotions": promotions }))
    }

    /// One promotion as `list_promotions` lists it: the fixture's fields plus whether it is storewide, the
    /// live room's promotion now, and still running.
    fn promotion_entry(&self, promo: &Promotion) -> Value {
        let mut v = serde_json::to_value(promo).expect("promotion serialises");
        v["storewide"] = json!(promo.applies_to.is_storewide());
        v["live_room_now"] = json!(self.room.ongoing_promotion.as_deref().is_some_and(|c| eq_ci(c, &promo.code)));
        v["running"] = json!(self.is_running(promo));
        v
    }

    /// `list_promotions`: all promotions running now, or those that apply to one product.
    pub fn list_promotions(&self, product_id: Option<&str>) -> Result<Value, String> {
        self.list_promotions_narrowed(product_id, None, None)
    }

    /// `shipping_policy` with `fields`: one region's terms narrowed to those fields (e.g. "fee" or
    /// "free_over,fee"; the region's name and the currency always stay). Fields need a region.
    pub fn shipping_policy_fields(&self, region: Option<&str>, fields: Option<&str>) -> Result<Value, String> {
        let mut v = self.shipping_policy(region)?;
        if fields.is_none_or(|f| f.trim().is_empty()) {
            return Ok(v);
        }
        if v.get("region").is_none() {
            return Err("shipping_policy: `fields` selects from one region's terms: give a region too.".into());
        }
        let terms = select_fields(v["region"].take(), fields, &["region"], "shipping_policy")?;
        Ok(json!({ "currency": self.currency, "region": terms }))
    }

    /// `shipping_policy`: the whole policy, or one region's terms.
    pub fn shipping_policy(&self, region: Option<&str>) -> Result<Value, String> {
        let s = &self.shipping;
        let region = region.map(str::trim).filter(|r| !r.is_empty());
        let Some(r) = region else {
            return Ok(json!({ "currency": self.currency, "policy": s }));
        };
        let q = norm(r);
        let found = s
            .regions
            .iter()
            .find(|x| norm(&x.region) == q || x.aliases.iter().any(|a| norm(a) == q))
            .or_else(|| {
                s.regions.iter().find(|x| {
                    norm(&x.region).contains(&q) || x.aliases.iter().any(|a| q.contains(&norm(a)))
                })
            });
        match found {
            Some(x) => Ok(json!({
                "currency": self.currency,
                "carrier": s.carrier,
                "dispatch": s.dispatch,
                "region": x,
                "notes": s.notes,
            })),
            None => Err(format!(
                "No shipping terms for region '{r}'. Known regions: {}.",
                s.regions
                    .iter()
                    .map(|x| x.region.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// `after_sales_policy`: returns, exchanges, refunds.
    pub fn after_sales_policy(&self) -> Value {
        self.after_sales.clone()
    }

    /// `after_sales_policy` with `fields`: only those parts of the policy (e.g. "exchange_window_days").
    pub fn after_sales_policy_fields(&self, fields: Option<&str>) -> Result<Value, String> {
        select_fields(self.after_sales_policy(), fields, &[], "after_sales_policy")
    }

    /// `room_status`: the live room, with the product on screen and the running promotion
    /// expanded.
    pub fn room_status(&self) -> Value {
        let r = &self.room;
        let current = r
            .current_product_id
            .as_deref()
            .and_then(|id| self.product(id))
            .map(Self::summary);
        let promo = r
            .ongoing_promotion
            .as_deref()
            .and_then(|c| self.promotion(c))
            .filter(|p| self.is_running(p))
            .map(|p| {
                json!({ "code": p.code, "title": p.title, "description": p.description,
                    "discount": p.discount, "valid_until": p.valid_until })
            });
        let up_next: Vec<Value> = r
            .up_next
            .iter()
            .filter_map(|id| self.product(id))
            .map(|p| json!({ "id": p.id, "name": p.name }))
            .collect();
        json!({
            "title": r.title,
            "host": r.host,
            "live": r.live,
            "started_at": r.started_at,
            "viewers": r.viewers,
            "likes": r.likes,
            "current_product": current,
            "ongoing_promotion": promo,
            "up_next": up_next,
            "announcement": r.announcement,
        })
    }
}

/// `v` (a JSON object) narrowed to `fields` (names separated by commas; none or empty: all of `v`), with
/// the `always` keys kept. An unknown name is an error that lists the names there are.
fn select_fields(v: Value, fields: Option<&str>, always: &[&str], tool: &str) -> Result<Value, String> {
    let Some(fields) = fields.map(str::trim).filter(|f| !f.is_empty()) else {
        return Ok(v);
    };
    let Value::Object(all) = v else {
        return Ok(v);
    };
    let wanted: Vec<&str> = fields.split(',').map(str::trim).filter(|f| !f.is_empty()).collect();
    if let Some(bad) = wanted.iter().find(|f| !all.contains_key(**f)) {
        let known: Vec<&str> = all.keys().map(String::as_str).filter(|k| !always.contains(k)).collect();
        return Err(format!("{tool}: no field '{bad}'. Fields: {}.", known.join(", ")));
    }
    Ok(Value::Object(
        all.into_iter()
            .filter(|(k, _)| always.contains(&k.as_str()) || wanted.contains(&k.as_str()))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bundled catalog as of the room's start, when every promotion is still running.
    fn cat() -> Catalog {
        at("2026-11-29T20:00:00+08:00")
    }

    fn at(now: &str) -> Catalog {
        Catalog::load(&default_data_path())
            .expect("bundled catalog loads")
            .with_now(Catalog::parse_now(now).unwrap())
    }

    fn codes(v: &Value) -> Vec<String> {
        v["promotions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["code"].as_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn expired_promotions_are_listed_nowhere() {
        let before = cat();
        assert!(codes(&before.list_promotions(None).unwrap()).contains(&"FLASH100".to_owned()));
        // FLASH100 ended 2026-11-30T23:59:59+08:00.
        let c = at("2026-12-01T10:00:00+08:00");
        let all = codes(&c.list_promotions(None).unwrap());
        assert!(
            !all.contains(&"FLASH100".to_owned()) && all.contains(&"LIVE20".to_owned()),
            "{all:?}"
        );
        let p = c.get_product("p007").unwrap();
        let product_codes: Vec<&str> = p["promotion_codes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap())
            .collect();
        assert!(
            !product_codes.contains(&"FLASH100") && product_codes.contains(&"LIVE20"),
            "{product_codes:?}"
        );
        assert_eq!(c.room_status()["ongoing_promotion"]["code"], "LIVE20");
        // After LIVE20 ends, the room runs no promotion rather than an expired one.
        let later = at("2027-01-01T00:00:00+08:00");
        assert!(later.room_status()["ongoing_promotion"].is_null());
        assert_eq!(
            codes(&later.list_promotions(None).unwrap()),
            vec!["WELCOME30".to_owned()]
        );
        // The boundary second itself still counts.
        assert!(
            codes(
                &at("2026-11-30T23:59:59+08:00")
                    .list_promotions(None)
                    .unwrap()
            )
            .contains(&"FLASH100".to_owned())
        );
        assert!(
            Catalog::parse_now("yesterday")
                .unwrap_err()
                .contains("RFC 3339")
        );
    }

    #[test]
    fn products_carry_their_link_id() {
        let c = cat();
        assert_eq!(c.get_product("p007").unwrap()["link_id"], "lk-p007");
        let v = c.search_products("puffer", None).unwrap();
        assert_eq!(v["results"][0]["link_id"], "lk-p007");
        assert_eq!(c.room_status()["current_product"]["link_id"], "lk-p007");
    }

    #[test]
    fn invalid_valid_until_is_a_load_error() {
        let mut c = cat();
        c.promotions[0].valid_until = "end of year".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("valid_until") && e.contains("LIVE20"), "{e}");
    }

    #[test]
    fn bundled_catalog_is_valid_and_complete() {
        let c = cat();
        assert!(c.products.len() >= 12);
        for p in &c.products {
            for colour in &p.colours {
                for size in &p.sizes {
                    assert!(
                        c.stock.iter().any(|s| s.product_id == p.id
                            && &s.colour == colour
                            && &s.size == size),
                        "no stock row for {} {colour} {size}",
                        p.id
                    );
                }
            }
        }
        assert!(
            c.stock.iter().any(|s| s.quantity == 0),
            "some variant is sold out"
        );
        assert!(
            c.stock
                .iter()
                .any(|s| s.quantity > 0 && s.quantity <= LOW_STOCK),
            "some variant is low"
        );
    }

    #[test]
    fn validation_rejects_dangling_references() {
        let mut c = cat();
        c.stock[0].colour = "Ultraviolet".into();
        assert!(c.validate().is_err());
        let mut c = cat();
        c.room.current_product_id = Some("p999".into());
        assert!(c.validate().is_err());
        let mut c = cat();
        c.promotions[0].applies_to.product_ids.push("nope".into());
        assert!(c.validate().is_err());
    }

    #[test]
    fn search_matches_words_and_plurals() {
        let c = cat();
        let v = c.search_products("puffer jacket", None).unwrap();
        assert_eq!(v["results"][0]["id"], "p007");
        let v = c.search_products("JEANS", Some(3)).unwrap();
        assert_eq!(v["results"][0]["id"], "p003");
        let v = c.search_products("merino", None).unwrap();
        assert_eq!(v["results"][0]["id"], "p006");
        let v = c.search_products("tees", None).unwrap();
        assert_eq!(v["results"][0]["id"], "p001");
        let v = c.search_products("black", Some(2)).unwrap();
        assert_eq!(v["results"].as_array().unwrap().len(), 2);
        assert!(v["total_matches"].as_u64().unwrap() > 2);
        let v = c.search_products("spaceship", None).unwrap();
        assert_eq!(v["total_matches"], 0);
        assert!(c.search_products("  ", None).is_err());
        assert!(c.search_products("tee", Some(0)).is_err());
    }

    #[test]
    fn stock_filters_case_insensitively_and_rejects_unknown_variants() {
        let c = cat();
        let v = c
            .check_stock("p007", Some("dusty pink"), Some("m"))
            .unwrap();
        assert_eq!(v["variants"].as_array().unwrap().len(), 1);
        assert_eq!(v["variants"][0]["status"], "sold out");
        assert_eq!(v["available"], false);
        let v = c.check_stock("P007", None, None).unwrap();
        assert_eq!(v["variants"].as_array().unwrap().len(), 12);
        let e = c.check_stock("p007", Some("Purple"), None).unwrap_err();
        assert!(
            e.contains("Available colours: Black, Olive, Dusty Pink"),
            "{e}"
        );
        let e = c.check_stock("p007", None, Some("XXL")).unwrap_err();
        assert!(e.contains("Available sizes"), "{e}");
        let e = c.check_stock("p404", None, None).unwrap_err();
        assert!(
            e.contains("Unknown product 'p404'") && e.contains("search_products"),
            "{e}"
        );
    }

    #[test]
    fn promotions_apply_by_product_category_and_storewide() {
        let c = cat();
        let codes = |v: Value| -> Vec<String> {
            v["promotions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["code"].as_str().unwrap().to_owned())
                .collect()
        };
        let all = codes(c.list_promotions(None).unwrap());
        assert_eq!(all.len(), c.promotions.len());
        let puffer = codes(c.list_promotions(Some("p007")).unwrap());
        assert!(puffer.contains(&"LIVE20".to_owned()) && puffer.contains(&"SCARF50".to_owned()));
        assert!(puffer.contains(&"WELCOME30".to_owned()) && !puffer.contains(&"KNIT2".to_owned()));
        let tee = codes(c.list_promotions(Some("p001")).unwrap());
        assert!(tee.contains(&"KNIT2".to_owned()) && !tee.contains(&"LIVE20".to_owned()));
        assert!(c.list_promotions(Some("p000")).is_err());
    }

    #[test]
    fn promotion_code_and_fields_narrow_the_list() {
        // After FLASH100 ended (2026-11-30) and before KNIT2 ends (2026-12-15).
        let c = at("2026-12-01T10:00:00+08:00");
        let v = c.list_promotions_narrowed(None, Some("knit2"), Some("valid_until")).unwrap();
        assert_eq!(codes(&v), ["KNIT2"]);
        let entry = v["promotions"][0].as_object().unwrap();
        let mut keys: Vec<&str> = entry.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, ["code", "running", "valid_until"]);
        assert_eq!(entry["running"], json!(true));
        // An ended code is still answered, marked as ended; the plain list leaves it out.
        let flash = c.list_promotions_narrowed(None, Some("FLASH100"), None).unwrap();
        assert_eq!(codes(&flash), ["FLASH100"]);
        assert_eq!(flash["promotions"][0]["running"], json!(false));
        assert!(!codes(&c.list_promotions_narrowed(None, None, None).unwrap()).contains(&"FLASH100".to_owned()));
        // With a product: the code only if it applies to it.
        assert_eq!(codes(&c.list_promotions_narrowed(Some("p007"), Some("LIVE20"), None).unwrap()), ["LIVE20"]);
        assert!(codes(&c.list_promotions_narrowed(Some("p001"), Some("LIVE20"), None).unwrap()).is_empty());
        // Fields apply to every entry of a product's list.
        let tee = c.list_promotions_narrowed(Some("p001"), None, Some("discount")).unwrap();
        assert!(codes(&tee).contains(&"KNIT2".to_owned()));
        assert!(tee["promotions"].as_array().unwrap().iter().all(|e| e.as_object().unwrap().len() == 3));
        // Unknown code or field: an error naming it and what exists.
        let e = c.list_promotions_narrowed(None, Some("FREE99"), None).unwrap_err();
        assert!(e.contains("'FREE99'") && e.contains("LIVE20") && !e.contains("FLASH100"), "{e}");
        let e = c.list_promotions_narrowed(None, Some("LIVE20"), Some("percent")).unwrap_err();
        assert!(e.contains("'percent'") && e.contains("valid_until"), "{e}");
        assert!(c.list_promotions_narrowed(Some("p000"), Some("LIVE20"), None).is_err());
    }

    #[test]
    fn fields_narrow_product_shipping_and_after_sales_answers() {
        let c = cat();
        let keys = |v: &Value| -> Vec<String> {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        };
        let v = c.get_product_fields("p011", Some("price, material")).unwrap();
        assert_eq!(keys(&v), ["id", "material", "name", "price"]);
        assert_eq!(v["price"], 159.0);
        assert_eq!(c.get_product_fields("p011", None).unwrap(), c.get_product("p011").unwrap());
        assert_eq!(c.get_product_fields("p011", Some(" ")).unwrap(), c.get_product("p011").unwrap());
        let e = c.get_product_fields("p011", Some("price,colour")).unwrap_err();
        assert!(e.contains("no field 'colour'") && e.contains("colours") && !e.contains(" id,"), "{e}");
        let v = c.shipping_policy_fields(Some("tw"), Some("delivery_days")).unwrap();
        assert_eq!(keys(&v), ["currency", "region"]);
        assert_eq!(keys(&v["region"]), ["delivery_days", "region"]);
        assert_eq!(v["region"]["region"], "Taiwan");
        let e = c.shipping_policy_fields(None, Some("fee")).unwrap_err();
        assert!(e.contains("give a region"), "{e}");
        assert!(c.shipping_policy_fields(Some("tw"), Some("price")).unwrap_err().contains("fee, free_over"));
        let v = c.after_sales_policy_fields(Some("exchange_window_days")).unwrap();
        assert_eq!(v, json!({"exchange_window_days": 15}));
        assert_eq!(c.after_sales_policy_fields(None).unwrap(), c.after_sales_policy());
    }

    #[test]
    fn shipping_by_region_and_alias() {
        let c = cat();
        let v = c.shipping_policy(Some("HK")).unwrap();
        assert_eq!(v["region"]["region"], "Hong Kong & Macau");
        let v = c.shipping_policy(Some("mainland china")).unwrap();
        assert_eq!(v["region"]["free_over"], 99.0);
        let v = c.shipping_policy(None).unwrap();
        assert_eq!(
            v["policy"]["regions"].as_array().unwrap().len(),
            c.shipping.regions.len()
        );
        let e = c.shipping_policy(Some("Mars")).unwrap_err();
        assert!(e.contains("Known regions"), "{e}");
    }

    #[test]
    fn room_status_expands_product_and_promotion() {
        let c = cat();
        let v = c.room_status();
        assert_eq!(v["current_product"]["id"], "p007");
        assert_eq!(v["ongoing_promotion"]["code"], "LIVE20");
        assert!(v["viewers"].as_u64().unwrap() > 0);
        let v = c.get_product("p007").unwrap();
        assert_eq!(v["on_screen_now"], true);
        let v = c.get_product("classic crew tee").unwrap();
        assert_eq!(v["id"], "p001");
    }
}
