#!/usr/bin/env python3
"""Deterministic synthetic corpus: live-stream commerce chats in the chat-message format.

    python tools/train/corpus.py --seed 1234 --out tools/train/work/corpus

Writes `train.jsonl`, `test.jsonl` (one conversation per line: {"messages": [...], "tools": [...] | null})
and `catalogue.json` (the fixed shop catalogue the host "knows"). Everything is a pure function of the
seed (Python's `random.Random`, no hashing of str, no wall clock).

Design (what a tiny model can learn, and what exercises the engine):
  * a fixed catalogue (names, prices, colours, sizes, materials, fit) that the host answers from memory;
  * fresh data (stock per size, order status, today's coupons, returns) only through tools, in the
    Qwen3.5 XML format (`<tool_call>` / `<function=...>` / `<parameter=...>`) with `tool` turns;
    without tools the host answers such questions generically;
  * many viewer-comment intents (price, size, stock, shipping, after-sales, greetings, chit-chat,
    negative feedback, multi-question comments), optional "name: comment" prefixes, a little Chinese;
  * short spoken host replies;
  * optional system prompt (host persona), optional tools, 1-3 viewer turns.
"""

import argparse
import json
import random
from pathlib import Path

# ----------------------------------------------------------------------------------------------
# Catalogue (fixed facts)
# ----------------------------------------------------------------------------------------------
APPAREL = ["S", "M", "L", "XL"]
SHOES = ["36", "37", "38", "39", "40", "41", "42", "43", "44"]
ONE = ["one size"]

# item, category, price, regular price, colours, sizes, material, fit note
ITEMS = [
    ("hoodie", "apparel", 39.99, 59.99, ["blue", "black", "grey"], APPAREL, "soft cotton fleece", "runs true to size"),
    ("t-shirt", "apparel", 15.99, 24.99, ["white", "black", "green"], APPAREL, "100% organic cotton", "runs a little small, so size up"),
    ("denim jacket", "apparel", 54.99, 79.99, ["blue", "black"], APPAREL, "heavy cotton denim with metal buttons", "runs a little large"),
    ("yoga leggings", "apparel", 24.99, 34.99, ["black", "purple", "grey"], ["XS", "S", "M", "L"], "stretchy nylon and spandex", "are high waisted and run true to size"),
    ("linen shirt", "apparel", 29.99, 44.99, ["white", "beige"], APPAREL, "breathable pure linen", "has a relaxed fit"),
    ("knit sweater", "apparel", 44.99, 69.99, ["cream", "red", "green"], APPAREL, "merino wool blend", "is oversized, so take your usual size"),
    ("rain jacket", "apparel", 49.99, 74.99, ["yellow", "navy"], APPAREL, "waterproof recycled polyester", "fits over a sweater"),
    ("sneakers", "shoes", 59.99, 89.99, ["white", "black"], SHOES, "vegan leather with a rubber sole", "run half a size small"),
    ("baseball cap", "accessory", 12.99, 19.99, ["black", "beige", "blue"], ONE, "washed cotton twill", "has an adjustable strap"),
    ("wool scarf", "accessory", 19.99, 29.99, ["red", "grey"], ONE, "soft lambswool", "is long enough to wrap twice"),
    ("face cream", "beauty", 29.99, 45.00, [], ONE, "shea butter and hyaluronic acid", "is fragrance free"),
    ("vitamin C serum", "beauty", 24.99, 39.99, [], ONE, "15% vitamin C with vitamin E", "is gentle on sensitive skin"),
    ("lipstick set", "beauty", 19.90, 32.00, [], ONE, "four matte shades", "is long lasting"),
    ("sunscreen", "beauty", 14.99, 21.99, [], ONE, "SPF 50 mineral formula", "leaves no white cast"),
    ("mug set", "home", 22.99, 34.99, ["white", "blue"], ONE, "stoneware ceramic, four mugs", "is dishwasher safe"),
    ("scented candle", "home", 16.99, 25.00, [], ONE, "soy wax with a cotton wick", "burns for about 50 hours"),
    ("throw blanket", "home", 34.99, 49.99, ["grey", "cream"], ONE, "plush sherpa fleece", "is machine washable"),
    ("cutting board", "home", 18.99, 27.99, [], ONE, "solid bamboo", "has a juice groove"),
    ("wireless earbuds", "tech", 39.99, 69.99, ["white", "black"], ONE, "Bluetooth 5.3 with noise cancelling", "last 30 hours with the case"),
    ("phone stand", "tech", 9.99, 15.99, ["silver", "black"], ONE, "aluminium", "folds flat"),
    ("power bank", "tech", 27.99, 39.99, ["black"], ONE, "10000 mAh with fast charging", "charges a phone about twice"),
    ("water bottle", "home", 17.99, 24.99, ["green", "pink", "black"], ONE, "insulated stainless steel", "keeps drinks cold for 24 hours"),
]

# Size chart for apparel: chest in cm per size.
CHEST = {"XS": 84, "S": 92, "M": 100, "L": 108, "XL": 116}

SHIPPING = {
    "the US": ("free over $50, otherwise $5.99", "3 to 5 business days"),
    "Canada": ("$9.99", "5 to 8 business days"),
    "the UK": ("$14.99", "7 to 10 business days"),
    "Australia": ("$19.99", "10 to 14 business days"),
    "Germany": ("$14.99", "7 to 10 business days"),
    "Mexico": ("$12.99", "6 to 9 business days"),
}
REGION_ALIASES = {
    "the US": ["the US", "the USA", "the States", "Texas", "California", "New York", "Florida"],
    "Canada": ["Canada", "Toronto", "Vancouver"],
    "the UK": ["the UK", "London", "England"],
    "Australia": ["Australia", "Sydney"],
    "Germany": ["Germany", "Berlin"],
    "Mexico": ["Mexico"],
}
COUPON_STATIC = "LIVE10"  # always-on stream code: 10% off orders over $50

HOSTS = [("Mia", "Cozy Corner"), ("Leo", "Daily Finds"), ("Ava", "Glow Shop"), ("Sam", "Street Style Live"), ("Nora", "Home & Co")]
DEFAULT_HOST = HOSTS[0]

NAMES = [
    "Sarah", "Mike", "Jenny", "Carlos", "Aisha", "Tom", "Linda", "Kevin", "Priya", "Emma", "Jake", "Olivia",
    "Noah", "Sofia", "Liam", "Chloe", "Ben", "Grace", "Omar", "Hannah", "Lucas", "Zoe", "Ethan", "Mei",
    "Daniel", "Fatima", "Ryan", "Julia", "Marco", "Nina", "Alex", "Rosa", "David", "Lily", "Sam", "Ivy",
]
USERNAMES = ["shopgirl22", "mike_t", "jen.xo", "carlos88", "aisha_k", "tommyb", "lindaloves", "kev_in", "priya.p",
             "emma_rose", "jakey", "liv_o", "noah99", "sofi", "lucasm", "zoe.z", "grace_h", "benji", "mei_mei", "dan_the_man"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "check_stock",
            "description": "Live stock count of a product, per size and colour.",
            "parameters": {
                "type": "object",
                "properties": {
                    "product": {"type": "string", "description": "Product name"},
                    "size": {"type": "string", "description": "Size, if the viewer gave one"},
                    "color": {"type": "string", "description": "Colour, if the viewer gave one"},
                },
                "required": ["product"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "track_order",
            "description": "Status and delivery estimate of an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "description": "Order number"}},
                "required": ["order_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_coupons",
            "description": "Coupons and flash deals running right now.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "start_return",
            "description": "Open a return or replacement for an order.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "description": "Order number"},
                    "reason": {"type": "string", "description": "Short reason"},
                },
                "required": ["order_id", "reason"],
            },
        },
    },
]


def money(x):
    return f"${x:.2f}"


class Product:
    def __init__(self, item, color=None):
        (self.item, self.cat, self.price, self.regular, self.colors, self.sizes, self.material, self.fit) = next(
            t for t in ITEMS if t[0] == item
        )
        self.color = color

    @property
    def name(self):
        return f"{self.color} {self.item}" if self.color else self.item

    @property
    def plural(self):
        return self.item.endswith("s") or self.item in ("yoga leggings", "sneakers")


def catalogue():
    return [
        {
            "item": it[0], "category": it[1], "price": it[2], "regular_price": it[3], "colors": it[4],
            "sizes": it[5], "material": it[6], "fit": it[7],
        }
        for it in ITEMS
    ]


# ----------------------------------------------------------------------------------------------
# Generator
# ----------------------------------------------------------------------------------------------
class Gen:
    def __init__(self, rng):
        self.r = rng

    def c(self, xs):
        return self.r.choice(xs)

    def p(self, prob):
        return self.r.random() < prob

    # --- products -------------------------------------------------------------------------------
    def product(self, cats=None):
        items = [it for it in ITEMS if cats is None or it[1] in cats]
        it = self.c(items)
        color = self.c(it[4]) if it[4] and self.p(0.8) else None
        return Product(it[0], color)

    def size_of(self, prod):
        return None if prod.sizes == ONE else self.c(prod.sizes)

    def ref(self, prod):
        """How a viewer names a product."""
        if prod.color and self.p(0.85):
            return self.c(["the ", "the ", "the ", "the ", "that ", "this ", ""]) + prod.name
        prod.color = None  # the viewer did not say a colour, so the host will not either
        return self.c(["the ", "the ", "the ", "the ", "that ", "this ", ""]) + prod.item

    def it_word(self, prod):
        return "they" if prod.plural else "it"

    # --- pieces of host speech -----------------------------------------------------------------
    def cta(self):
        return self.c([
            "Tap the yellow bag to grab it!", "Link is in the yellow bag!", "Add it to your cart before it's gone!",
            "Tap the bag below to order!", "Grab it while the live price lasts!", "Don't miss it, the deal ends tonight!",
            "",
        ])

    def hey(self, name):
        if name:
            return self.c([f"Hi {name}! ", f"Hey {name}! ", f"Great question {name}! ", f"Thanks {name}! ", f"Hi {name}! "])
        return self.c(["", "", "Great question! ", "Sure! ", "Good question! ", "Okay! "])

    def hi(self, name):
        return f"Hi {name}! " if name else ""

    def join(self, *parts):
        parts = [s.strip() for s in parts if s and s.strip()]
        # Spoken style, and an easy copy pattern: "Great question Julia, the yoga leggings are ..."
        # echoes the viewer's "... the yoga leggings".
        if len(parts) >= 2 and parts[0].endswith("!") and parts[1].startswith("The ") and self.p(0.75):
            parts[:2] = [parts[0][:-1] + ", the " + parts[1][4:]]
        elif parts and parts[0].startswith("The ") and self.p(0.5):
            parts[0] = self.c(["So the ", "Okay, the ", "Yes, the "]) + parts[0][4:]
        return " ".join(parts)

    def price_sentence(self, prod, qty=1):
        be = "are" if prod.plural else "is"
        s = f"The {prod.name} {be} {money(prod.price)} on the live today"
        if self.p(0.6):
            s += f", down from {money(prod.regular)}"
        s += "."
        if qty > 1:
            s += f" So {qty} would be {money(prod.price * qty)}."
            if prod.price * qty > 50 and self.p(0.7):
                s += f" That's over $50, so code {COUPON_STATIC} takes 10% off!"
        return s

    def size_advice(self, prod, height=None):
        if prod.cat == "shoes":
            return f"The {prod.item} {prod.fit}, so go half a size up from your usual."
        if prod.sizes == ONE:
            return f"The {prod.name} is one size, and it {prod.fit}."
        if height is not None:
            idx = 0 if height < 160 else 1 if height < 170 else 2 if height < 180 else 3
            sizes = prod.sizes
            idx = min(idx, len(sizes) - 1)
            return f"At {height} cm I'd take the {sizes[idx]} in the {prod.item}. It {prod.fit}."
        return f"The {prod.item} {prod.fit}."

    # --- intents: each returns (user_text, plan) where plan builds the assistant side -----------
    # plan(tools_on) -> list of messages to append (assistant / tool / assistant)

    def intent_greeting(self, name, host):
        place = self.c([a for v in REGION_ALIASES.values() for a in v])
        prod = self.product()
        who = name or "there"
        if self.p(0.2):
            u = self.c(["hi {host}, how are you?", "how are you {host}?", "hello {host}! how's it going?"]).format(host=host[0])
            a = f"Hi {who}! I'm doing great, thanks for asking. Welcome to {host[1]}!"
            return u, lambda tools: [asst(a)]
        u = self.c([
            "hi!", "hello", "hey everyone", "hi from {place}!", "first time here", "hello {host}!", "good evening",
            "hey hey", "just joined", "hi there, what are we selling today?", "love this stream", "back again!",
            "watching from {place}",
        ]).format(place=place, host=host[0])
        a = self.c([
            f"Hi {who}, welcome to the stream! Today we have great deals, like the {prod.name} for {money(prod.price)}.",
            f"Hello {who}! So happy you're here. Don't forget to follow for a coupon!",
            f"Hey {who}, welcome! We're showing the {prod.name} right now, only {money(prod.price)} on the live.",
            f"Welcome{' ' + name if name else ''}! Grab a seat, tonight's deals are really good.",
        ])
        return u, lambda tools: [asst(a)]

    def intent_price(self, name, host):
        prod = self.product()
        ref = self.ref(prod)
        size = self.size_of(prod)
        qty = 1
        form = self.r.randrange(8)
        if form == 0 and size:
            u = f"how much is {ref} in size {size}?"
        elif form == 1:
            qty = self.c([2, 2, 3])
            u = self.c(["how much for {q} {i}?", "price for {q} of {r}?", "if I buy {q} {i} how much?"]).format(
                q=qty, i=prod.item if prod.plural else prod.item + "s", r=ref)
        elif form == 2:
            u = f"{ref} price?"
        elif form == 3:
            u = f"is {ref} on sale?"
        elif form == 4:
            u = f"how much is {ref}"
        elif form == 5:
            u = f"what's the price of {ref}?"
        elif form == 6:
            u = f"price pls {ref}"
        else:
            u = f"How much does {ref} cost?"
        s = self.price_sentence(prod, qty)
        if form == 0 and size:
            s += f" Same price for every size, {size} included."
        a = self.join(self.hey(name), s, self.cta())
        return u, lambda tools: [asst(a)]

    def intent_size(self, name, host):
        prod = self.product(["apparel", "shoes"])
        ref = self.ref(prod)
        form = self.r.randrange(5)
        height = None
        if form == 0:
            height = self.r.randrange(150, 192)
            u = f"I'm {height} cm, what size {ref}?"
        elif form == 1:
            height = self.r.randrange(150, 192)
            u = f"what size should I get in {ref}? I am {height}cm"
        elif form == 2:
            u = f"{'do' if prod.plural else 'does'} {ref} run small?"
        elif form == 3:
            u = f"what sizes does {ref} come in?"
        else:
            u = f"{'are' if prod.plural else 'is'} {ref} true to size?"
        if form == 3:
            sizes = prod.sizes
            s = f"The {prod.item} comes in sizes {', '.join(sizes[:-1])} and {sizes[-1]}."
            if prod.cat == "apparel" and self.p(0.5):
                s += f" The M fits a {CHEST['M']} cm chest."
        else:
            s = self.size_advice(prod, height)
        a = self.join(self.hey(name), s, self.cta() if self.p(0.5) else "")
        return u, lambda tools: [asst(a)]

    def intent_material(self, name, host):
        prod = self.product()
        ref = self.ref(prod)
        u = self.c(["what is {r} made of?", "material of {r}?", "is {r} good quality?", "tell me about {r}",
                    "what's {r} like?"]).format(r=ref)
        be = "are" if prod.plural else "is"
        s = f"The {prod.name} {be} {prod.material}, and {self.it_word(prod)} {prod.fit}."
        if prod.item == "face cream" or prod.item == "vitamin C serum":
            s += " Great for sensitive skin too."
        a = self.join(self.hey(name), s, self.cta() if self.p(0.5) else "")
        return u, lambda tools: [asst(a)]

    def intent_colors(self, name, host):
        it = self.c([t for t in ITEMS if len(t[4]) >= 2])
        prod = Product(it[0])
        u = self.c(["what colors does the {i} come in?", "any other colours for the {i}?", "{i} colors?",
                    "does the {i} come in {c}?"]).format(i=prod.item, c=self.c(["pink", "red", "blue", "black", "green"]))
        cols = prod.colors
        s = f"The {prod.item} comes in {', '.join(cols[:-1])} and {cols[-1]}."
        a = self.join(self.hey(name), s, self.cta() if self.p(0.5) else "")
        return u, lambda tools: [asst(a)]

    def stock_answer(self, prod, size, count):
        nm = prod.name + (f" in {size}" if size else "")
        if count == 0:
            return self.c([f"Sorry, the {nm} is sold out right now.", f"Oh no, the {nm} just sold out!"])
        if count <= 5:
            return self.c([f"Hurry, only {count} left of the {nm}!", f"Just {count} left of the {nm}, be quick!"])
        return self.c([f"Good news, we have {count} of the {nm} left!", f"Yes! {count} left of the {nm}."])

    def intent_stock(self, name, host):
        prod = self.product()
        ref = self.ref(prod)
        size = self.size_of(prod)
        if size and self.p(0.75):
            u = self.c(["is {r} in stock in {s}?", "do you have {r} in {s}?", "any {s} left in {r}?",
                        "{r} size {s} still available?"]).format(r=ref, s=size)
        else:
            size = None
            u = self.c(["is {r} in stock?", "do you still have {r}?", "{r} sold out?", "how many {r} left?"]).format(r=ref)
        count = self.c([0, 1, 2, 3, 4, 5, 6, 8, 12, 15, 20, 25, 33, 40, 57])

        def plan(tools):
            if not tools:
                s = self.c([
                    f"The {prod.name} is selling fast, so grab yours now!",
                    f"We still have some {prod.name} left, but it's going quickly!",
                    f"Let me look... yes, the {prod.name} is still available for now.",
                ])
                return [asst(self.join(self.hey(name), s, self.cta()))]
            args = {"product": prod.name}
            if size:
                args["size"] = size
            pre = self.c(["Let me check the stock.", "One sec, checking!", "", ""])
            resp = {"product": prod.name}
            if size:
                resp["size"] = size
            resp["stock"] = count
            s = self.stock_answer(prod, size, count)
            if count == 0 and size and prod.sizes != ONE and self.p(0.6):
                other = self.c([z for z in prod.sizes if z != size])
                s += f" Want me to check {other} for you?"
            return [
                asst(pre, [call("check_stock", args)]),
                tool(resp),
                asst(self.join(self.hey(name) if self.p(0.3) else "", s, "" if count == 0 else self.cta())),
            ]

        return u, plan

    def intent_shipping(self, name, host):
        region = self.c(list(SHIPPING))
        alias = self.c(REGION_ALIASES[region])
        fee, days = SHIPPING[region]
        form = self.r.randrange(4)
        if form == 0:
            u = f"do you ship to {alias}?"
            s = f"Yes, we ship to {region}! Shipping is {fee} and takes {days}."
        elif form == 1:
            u = f"how long does shipping take to {alias}?"
            s = f"Shipping to {region} takes {days}."
        elif form == 2:
            u = f"shipping cost to {alias}?"
            s = f"Shipping to {region} is {fee}."
        else:
            u = self.c(["is shipping free?", "free shipping?", "do you have free shipping?"])
            s = "Shipping is free in the US on orders over $50, otherwise $5.99."
        a = self.join(self.hey(name), s)
        return u, lambda tools: [asst(a)]

    def intent_coupon(self, name, host):
        u = self.c(["any discount codes?", "is there a coupon?", "any deals today?", "coupon code?",
                    "can I get a discount?", "any flash sale tonight?"])
        code = self.c(["FLASH15", "SAVE5", "VIP20", "NIGHT12", "WELCOME8"])
        pct = self.c([5, 8, 10, 12, 15, 20])
        mins = self.c([5, 10, 15, 20, 30])

        def plan(tools):
            base = f"Use code {COUPON_STATIC} for 10% off orders over $50. And follow the shop for an extra $5 coupon!"
            if not tools:
                return [asst(self.join(self.hey(name), base))]
            return [
                asst(self.c(["Let me see what's live.", "", ""]), [call("get_coupons", {})]),
                tool({"coupons": [{"code": code, "discount": f"{pct}% off", "ends_in_min": mins},
                                  {"code": COUPON_STATIC, "discount": "10% off over $50"}]}),
                asst(self.join(self.hey(name) if self.p(0.3) else "",
                               f"Right now code {code} gives {pct}% off for the next {mins} minutes! {COUPON_STATIC} also works for 10% off over $50.")),
            ]

        return u, plan

    def order_id(self):
        return str(self.r.randrange(10000, 99999))

    def intent_order(self, name, host):
        oid = self.order_id()
        u = self.c(["where is my order {o}?", "order {o} hasn't arrived", "when will order #{o} arrive?",
                    "can you check my order {o}", "my order number is {o}, any update?"]).format(o=oid)
        status = self.c(["shipped", "shipped", "processing", "out for delivery", "delivered"])
        eta = self.c(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "tomorrow", "Saturday"])
        carrier = self.c(["UPS", "FedEx", "USPS", "DHL"])

        def plan(tools):
            if not tools:
                return [asst(self.join(self.hi(name),
                                       f"So sorry for the wait! Please DM us order {oid} and our team will check it right after the live."))]
            resp = {"order_id": oid, "status": status, "carrier": carrier, "eta": eta}
            if status == "delivered":
                s = f"Order {oid} shows as delivered with {carrier}. If you can't find it, DM us and we'll help!"
            elif status == "processing":
                s = f"Order {oid} is still being packed, it should ship soon and arrive by {eta}."
            elif status == "out for delivery":
                s = f"Good news, order {oid} is out for delivery with {carrier} today!"
            else:
                s = f"Order {oid} has shipped with {carrier} and should arrive {eta if eta == 'tomorrow' else 'by ' + eta}."
            return [asst(self.c(["Let me check that order.", "", ""]), [call("track_order", {"order_id": oid})]),
                    tool(resp), asst(self.join(self.hey(name) if self.p(0.3) else "", s))]

        return u, plan

    def intent_return(self, name, host):
        problem = self.c([
            ("arrived broken", "damaged on arrival", "replacement"),
            ("is too small", "wrong size", "exchange"),
            ("is too big", "wrong size", "exchange"),
            ("is the wrong color", "wrong colour sent", "replacement"),
            ("doesn't fit", "wrong size", "exchange"),
            ("stopped working", "defective", "replacement"),
        ])
        cats = {"wrong size": ["apparel", "shoes"], "defective": ["tech"],
                "wrong colour sent": ["apparel", "shoes", "accessory", "home"]}.get(problem[1])
        prod = self.product(cats)
        with_id = self.p(0.6)
        oid = self.order_id()
        u = f"my {prod.item} {problem[0]}" + (f", order {oid}" if with_id else "") + self.c(["", "", " what do I do?", ", can I return it?"])

        def plan(tools):
            sorry = self.c(["Oh no, I'm so sorry!", "So sorry about that!", "Sorry to hear that!"])
            if tools and with_id:
                rid = f"R{self.r.randrange(1000, 9999)}"
                return [
                    asst(self.c([f"{sorry} Let me start that for you.", ""]),
                         [call("start_return", {"order_id": oid, "reason": problem[1]})]),
                    tool({"return_id": rid, "type": problem[2], "label": "emailed"}),
                    asst(self.join(self.hey(name) if self.p(0.3) else "",
                                   f"Done! Return {rid} is open for a free {problem[2]}, and the shipping label is in your email.")),
                ]
            tail = "Send us your order number in a DM and we'll fix it." if not with_id else \
                "Our team will message you about order " + oid + " right after the live."
            return [asst(self.join(self.hi(name), sorry, "You can return anything within 30 days for free.", tail))]

        return u, plan

    def intent_negative(self, name, host):
        prod = self.product()
        u = self.c(["this is overpriced", "too expensive lol", "the {i} looks cheap", "boring stream", "your shipping is so slow",
                    "I waited 3 weeks for my last order", "scam?", "quality was bad last time", "why is it sold out already??",
                    "customer service never answered me"]).format(i=prod.item)
        a = self.c([
            "I hear you, thanks for the honest feedback! Tonight's prices are the lowest we do all month.",
            "Sorry you feel that way! Every order has free 30-day returns, so you can try it risk free.",
            "Thank you for telling us. Please DM us your order number and we'll make it right.",
            "Totally fair, and I'm sorry! We're adding more stock next week, follow so you don't miss it.",
            "We're a real shop with thousands of happy buyers, and you can return anything within 30 days.",
        ])
        return u, lambda tools: [asst(self.join(self.hey(name) if self.p(0.3) else "", a))]

    def intent_chitchat(self, name, host):
        pairs = [
            (["what's your name?", "who are you?", "what is your name"], f"I'm {host[0]}, your host here at {host[1]}!"),
            (["love your earrings", "your hair looks great", "you're so pretty", "nice outfit!"],
             "Aww thank you, that's so sweet!"),
            (["where are you streaming from?", "where are you?"], "We're live from our studio in Los Angeles!"),
            (["what music is this?", "nice music", "song name?"], "It's our chill live playlist, glad you like it!"),
            (["how long is the live?", "when does the live end?"], "We're live for another hour, so stay with us!"),
            (["when is the next live?", "are you live tomorrow?"], "We go live every night at 8 pm, see you there!"),
            (["lol", "haha", "😂😂", "❤️❤️❤️", "so fun"], "Haha, you guys are the best!"),
            (["how are you?", "how is your day?"], "I'm great, thanks for asking! Happy to be live with you."),
            (["can you show the back?", "show it closer pls", "can you try it on?"], "Sure, here it is up close! Take a look."),
            (["what's the weather like there?"], "Sunny and warm here, perfect for some shopping!"),
        ]
        qs, a = self.c(pairs)
        return self.c(qs), lambda tools: [asst(self.join(self.hey(name) if self.p(0.3) else "", a))]

    def intent_multi(self, name, host):
        prod = self.product()
        region = self.c(list(SHIPPING))
        alias = self.c(REGION_ALIASES[region])
        fee, days = SHIPPING[region]
        form = self.r.randrange(3)
        if form == 0:
            u = f"how much is {self.ref(prod)} and do you ship to {alias}?"
            s = self.join(self.price_sentence(prod), f"And yes, we ship to {region}, it takes {days}.")
        elif form == 1 and prod.sizes != ONE:
            u = f"price of {self.ref(prod)}? and does it run small?"
            s = self.join(self.price_sentence(prod), self.size_advice(prod))
        else:
            u = f"what is {self.ref(prod)} made of and how much?"
            be = "are" if prod.plural else "is"
            s = self.join(f"The {prod.name} {be} {prod.material}.", self.price_sentence(prod))
        return u, lambda tools: [asst(self.join(self.hey(name), s, self.cta() if self.p(0.4) else ""))]

    def intent_multi_tool(self, name, host):
        """Stock question + order question in one comment: two tool calls when tools exist."""
        prod = self.product()
        size = self.size_of(prod)
        oid = self.order_id()
        u = f"is {self.ref(prod)}{' in ' + size if size else ''} in stock? also where is my order {oid}?"
        count = self.c([0, 2, 4, 7, 11, 18, 26])
        status = self.c(["shipped", "processing"])
        eta = self.c(["Monday", "Wednesday", "Friday", "tomorrow"])
        carrier = self.c(["UPS", "FedEx", "USPS"])

        def plan(tools):
            if not tools:
                return [asst(self.join(self.hey(name), f"The {prod.name} is still available for now!",
                                       f"For order {oid}, DM us and our team will check it."))]
            args = {"product": prod.name}
            if size:
                args["size"] = size
            resp = {"product": prod.name, **({"size": size} if size else {}), "stock": count}
            o = {"order_id": oid, "status": status, "carrier": carrier, "eta": eta}
            when = eta if eta == "tomorrow" else "by " + eta
            s2 = (f"Order {oid} has shipped with {carrier} and arrives {when}." if status == "shipped"
                  else f"Order {oid} is being packed and should arrive {when}.")
            return [
                asst(self.c(["Checking both!", ""]), [call("check_stock", args), call("track_order", {"order_id": oid})]),
                tool(resp), tool(o),
                asst(self.join(self.stock_answer(prod, size, count), s2)),
            ]

        return u, plan

    def intent_buy(self, name, host):
        prod = self.product()
        u = self.c(["I'll take {r}!", "just ordered {r}", "bought 2!", "added to cart", "ordering now", "how do I buy {r}?"]).format(
            r=self.ref(prod))
        if u.startswith("how do I"):
            a = f"Tap the yellow bag, pick the {prod.item}, choose your options and check out. Easy!"
        else:
            a = self.c(["Yay, thank you so much! You're going to love it.", "Amazing, thank you! Enjoy it!",
                        "Thank you! Your order ships within 2 days."])
        return u, lambda tools: [asst(self.join(self.hey(name) if self.p(0.5) else "", a))]

    def intent_chinese(self, name, host):
        prod = self.product(["beauty", "home"])
        pairs = [
            ("你好", f"你好，欢迎来到直播间！今天的{prod.item}只要{money(prod.price)}。"),
            ("主播好", "欢迎欢迎！记得点个关注哦。"),
            (f"{prod.item}多少钱？", f"{prod.item}今天直播价{money(prod.price)}，点击小黄车就可以下单！"),
            ("包邮吗？", "美国满50美元包邮，其他地区看运费说明哦。"),
            ("谢谢主播", "不客气，感谢支持！"),
        ]
        u, a = self.c(pairs)
        return u, lambda tools: [asst(a)]

    INTENTS = [
        ("greeting", 10), ("price", 18), ("size", 10), ("material", 6), ("colors", 5), ("stock", 13), ("shipping", 8),
        ("coupon", 5), ("order", 7), ("return", 5), ("negative", 5), ("chitchat", 7), ("multi", 6), ("multi_tool", 3),
        ("buy", 5), ("chinese", 2),
    ]

    def comment(self, host):
        names, weights = zip(*self.INTENTS)
        intent = self.r.choices(names, weights=weights)[0]
        name = self.c(NAMES) if self.p(0.45) else None
        u, plan = getattr(self, "intent_" + intent)(name, host)
        if name:
            u = f"{name}: {u}"
        elif self.p(0.15):
            u = u[0].upper() + u[1:]
        return intent, u, plan

    def conversation(self):
        tools_on = self.p(0.25)
        sys_on = self.p(0.2)
        host = self.c(HOSTS) if sys_on else DEFAULT_HOST
        msgs = []
        if sys_on:
            msgs.append({"role": "system", "content": self.c([
                f"You are {host[0]}, the host of the {host[1]} live stream. Reply to viewer comments in a short, friendly, spoken style.",
                f"You are {host[0]}, a live-stream shopping host for {host[1]}. Keep answers short.",
                f"You host the {host[1]} live sale. Your name is {host[0]}. Be brief and upbeat.",
            ])})
        n_turns = self.r.choices([1, 2, 3], weights=[40, 35, 25])[0]
        intents = []
        for _ in range(n_turns):
            intent, u, plan = self.comment(host)
            intents.append(intent)
            msgs.append({"role": "user", "content": u})
            msgs.extend(plan(tools_on))
        return {"intents": intents, "messages": msgs, "tools": TOOLS if tools_on else None}


def asst(content, calls=None):
    m = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = calls
    return m


def call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def tool(obj):
    return {"role": "tool", "content": json.dumps(obj, ensure_ascii=False)}


def build(seed, n_train, n_test):
    """n_train + n_test conversations; the test split never shares a first comment with train."""
    g = Gen(random.Random(seed))
    convs = [g.conversation() for _ in range(n_train + n_test)]
    test, train = convs[:n_test], convs[n_test:]
    train_first = {c["messages"][1 if c["messages"][0]["role"] == "system" else 0]["content"] for c in train}
    train_users = {m["content"] for c in train for m in c["messages"] if m["role"] == "user"}
    test = [c for c in test if first_user(c) not in train_first]
    return train, test, train_users


def first_user(c):
    return next(m["content"] for m in c["messages"] if m["role"] == "user")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train", type=int, default=60000)
    ap.add_argument("--test", type=int, default=1500)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    train, test, _ = build(a.seed, a.train, a.test)
    for name, rows in (("train", train), ("test", test)):
        with open(a.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for c in rows:
                f.write(json.dumps(c, ensure_ascii=False) + "\n")
    (a.out / "catalogue.json").write_text(json.dumps(catalogue(), indent=1) + "\n")
    print(f"corpus: {len(train)} train / {len(test)} test conversations -> {a.out}")


if __name__ == "__main__":
    main()
