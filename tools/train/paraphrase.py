"""Compositional viewer comments for agent_corpus.py (`--paraphrase P`).

The fixed banks give each intent two to four training sentences; the tiny model learned those sentences,
not the intent (a greeting it had not seen got a stock call, "any 43 left" got size 39). Here a comment is
built from parts: an intent core (several ways to ask, each with slots for the product alias, colour, size,
region), a slot spelling (colour/size order and separators), an optional opener and a closer, casing.
Every part list is split like the chatter banks: training draws the even entries, held-out cases the odd
ones, so corpus test.jsonl measures phrasings the model never saw. The parts are written from the catalogue
and generic live-chat habits, not from the replay's case set (bench/data/live_cases.jsonl), and
agent_corpus.py drops any training comment equal to one of those cases after normalisation.
"""

import re

OPENERS = ["hi ", "hey, ", "quick question: ", "host, ", "um ", "excuse me, ", "ok so ", "hello, ", "Xiaoman, ",
           "question - ", "so ", "hey host ", "wait ", "btw ", "yo ", "pls tell me "]
CLOSERS = ["", "?", "??", "", "?", " pls", "? thanks", " thx", "!", "?!", " please", " 🙏", "???", " ty", "? asap", " :)"]
ARTICLES = ["the ", "the ", "that ", "this ", "", "your "]

PRICE = ["how much is {t}{s}", "{s} price", "how much for {t}{s}", "price of {t}{s}", "what does {t}{s} cost",
         "{s} how much", "what's the price on {t}{s}", "{t}{s} costs how much", "price for {t}{s}", "{s} cost",
         "how much do I pay for {t}{s}", "what's {t}{s} going for", "{s}, how much", "how pricey is {t}{s}",
         "tell me the price of {t}{s}", "what is {t}{s} priced at", "{s} price check", "how much does {t}{s} go for",
         "whats {t}{s} price", "the price of {t}{s}", "price on {t}{s}", "{s} - how much", "cost of {t}{s}",
         "how much money is {t}{s}"]
MATERIAL = ["what's {t}{s} made of", "{s} material", "what fabric is {t}{s}", "{s} fabric", "what material is {t}{s}",
            "{s} made of what", "fabric of {t}{s}", "tell me about {t}{s} fabric", "what is {t}{s} made from",
            "{s} what material", "what's in {t}{s}, fabric wise", "is {t}{s} good material, what is it"]
COLOURS = ["what colours does {t}{s} come in", "{s} colours", "which colors for {t}{s}", "other colours for {t}{s}",
           "{s} in what colours", "colour options for {t}{s}", "does {t}{s} come in other colors", "{s} color choices",
           "how many colours for {t}{s}", "what colors is {t}{s} in"]
SIZES = ["what sizes does {t}{s} come in", "{s} sizes", "size range of {t}{s}", "which sizes for {t}{s}",
         "{s} available sizes", "what sizes are there for {t}{s}", "{s} size options", "sizes for {t}{s}",
         "how big do the sizes go for {t}{s}", "{s} what sizes"]
PRICE_MATERIAL = ["{s} price and material", "how much is {t}{s} and what fabric", "{s}: cost + fabric",
                  "price and fabric of {t}{s}", "what's {t}{s} made of and how much", "{s} how much, what material"]

# Stock: {v} is the variant (colour and size in one of VARIANT's spellings).
VARIANT = ["{c} {z}", "{z} {c}", "{c}, size {z}", "size {z} in {c}", "{c} / {z}", "{c} in {z}", "({c}, {z})",
           "{c} size {z}", "{c} in size {z}", "{z} in {c}", "{c}-{z}", "in {c}, {z}"]
STOCK = ["do you have {t}{s} {v}", "{s} {v} available", "any {v} left for {t}{s}", "{s} {v} in stock",
         "can I still get {t}{s} {v}", "is {t}{s} {v} sold out", "{v} {s} still there", "how many {s} {v} left",
         "need {t}{s} {v}", "{s} {v} stock", "I want {t}{s} {v}, any left", "got {t}{s} {v}",
         "is there {t}{s} {v}", "{v} of {t}{s}, any left", "looking for {t}{s} {v}", "{s} {v} still available",
         "still have {t}{s} {v}", "{v} {s} in stock", "is {t}{s} available {v}", "{s} {v} left",
         "any stock of {t}{s} {v}", "{s} {v}, is it gone", "{v} for {t}{s}, available", "{s} {v} can I order"]

PROMO_PRODUCT = ["any deal on {t}{s}", "is {t}{s} on sale", "{s} discount", "coupon for {t}{s}", "does {t}{s} have a promo",
                 "{s} any offer", "is there a code for {t}{s}", "can I get {t}{s} cheaper", "{s} on discount",
                 "promo for {t}{s}", "{s} coupon code", "discount on {t}{s}", "any offer for {t}{s}", "{s} cheaper with a code"]
PROMO_CODES = ["any coupons", "what promo codes are there", "any discount codes", "coupons today", "what deals are on",
               "is anything on sale", "which codes can I use", "got any vouchers", "what offers do you have",
               "any promotions running", "promo codes", "deals tonight", "any discounts", "what coupons are live",
               "list the deals", "sale codes"]
PROMO_WELCOME = ["new customer coupon", "first order discount", "I'm new, any coupon", "welcome discount",
                 "coupon for first time buyers", "first time buyer deal", "new here, any discount", "newbie coupon",
                 "discount for my first order", "new account coupon"]

SHIP_FEE = ["shipping to {a}", "how much is shipping to {a}", "delivery fee {a}", "{a} shipping cost", "postage to {a}",
            "what's shipping to {a}", "do you ship to {a}, how much", "cost to send to {a}", "{a} delivery fee",
            "shipping fee for {a}", "how much to deliver to {a}", "{a} postage cost"]
SHIP_DAYS = ["how long to {a}", "delivery time {a}", "how many days to {a}", "when will it arrive in {a}", "{a} how long",
             "shipping time to {a}", "how fast to {a}", "days to deliver to {a}", "{a} delivery days",
             "how long does shipping to {a} take"]
SHIP_FREE = ["free shipping to {a}", "{a} free delivery over how much", "is shipping free to {a}", "min for free shipping {a}",
             "free postage to {a}", "{a} free shipping from what amount", "when is delivery to {a} free",
             "free delivery {a}"]
DISPATCH = ["when do you ship", "when will my order go out", "do you ship same day", "how soon do you dispatch",
            "order now, ships when", "dispatch time", "when does it leave the warehouse", "how quick do orders ship"]

AFTER = {
    "return": ["can I return it", "return policy", "how many days to return", "can I send it back", "returns ok",
               "what if it doesn't fit, can I return", "is there a return window", "how do returns work",
               "no reason returns", "can I return if I don't like it", "return period", "returns allowed"],
    "exchange": ["can I exchange the size", "exchange policy", "swap for another colour", "can I change size later",
                 "exchange if too small", "how long can I exchange", "size swap ok", "exchange window"],
    "quality": ["it came damaged", "mine has a hole", "the zip broke already", "got a different item than I ordered",
                "the item is defective", "package arrived torn", "the colour is not what I ordered",
                "there's a stain on mine"],
    "refund": ["when do I get my refund", "how long for the refund", "refund time", "how fast do refunds come",
               "refund speed", "how many days until I get my money back"],
    "who_pays": ["who pays for returns", "return shipping free", "do I pay to send it back", "return postage on me",
                 "who covers the return fee", "is sending back free"],
    "contact": ["how do I contact support", "support hours", "when is customer service open", "is support online now",
                "how to talk to support", "where do I get help with an order"],
    "hygiene": ["can leggings be returned", "are leggings returnable", "return leggings if I tried them",
                "leggings refund ok"],
}
ROOM = ["what's this", "what are you wearing", "what's on show", "which product is this", "what is the host showing",
        "what's this item", "what's that one", "what are we looking at", "name of this item", "what is she wearing",
        "what's on screen", "which item now"]
JOIN = [" and ", ", also ", " + ", "? and ", ". also ", " & ", ", and ", "; "]

ZH_OPEN = ["", "请问", "主播，", "想问下", "那个", "你好，"]
ZH_CLOSE = ["", "？", "呀", "呢", "啊", "？？"]


def _norm(text):
    """Lower case, no 'Name: ' prefix, no punctuation or spaces: two comments that differ only there are the same."""
    text = re.sub(r"^[A-Za-z]+[:：]\s*", "", text.strip())
    return re.sub(r"[\W_]+", "", text.lower())


class Paraphraser:
    def __init__(self, rng):
        self.rng = rng

    def part(self, xs, held):
        return self.rng.choice(xs if len(xs) < 2 else (xs[1::2] if held else xs[0::2]))

    def frame(self, core, held):
        opener = self.part(OPENERS, held) if self.rng.random() < 0.3 else ""
        text = opener + core + self.part(CLOSERS, held)
        if self.rng.random() < 0.3:
            text = text[:1].upper() + text[1:]
        return text

    def fill(self, tpl, held, **slots):
        return tpl.format(t=self.part(ARTICLES, held), **slots)

    def product(self, what, alias, held):
        bank = {"price": PRICE, "material": MATERIAL, "colours": COLOURS, "sizes": SIZES, "price+material": PRICE_MATERIAL}[what]
        return self.fill(self.part(bank, held), held, s=alias)

    def stock(self, alias, colour, size, held):
        v = self.part(VARIANT, held).format(c=colour, z=size)
        return self.fill(self.part(STOCK, held), held, s=alias, v=v)

    def promo(self, kind, alias, held):
        if alias is not None:
            return self.fill(self.part(PROMO_PRODUCT, held), held, s=alias)
        return self.part(PROMO_WELCOME if kind == "welcome" else PROMO_CODES, held)

    def shipping(self, what, region, held):
        if what == "dispatch":
            return self.part(DISPATCH, held)
        bank = {"fee": SHIP_FEE, "free_over": SHIP_FREE, "days": SHIP_DAYS, "fee+days": SHIP_FEE}[what]
        core = self.part(bank, held).format(a=region)
        if what == "fee+days":
            core += self.part(JOIN, held) + self.part(["how long", "how many days", "delivery time", "how fast"], held)
        return core

    def after_sales(self, what, held):
        return self.part(AFTER[what], held)

    def room(self, held):
        return self.part(ROOM, held)

    def join(self, a, b, held):
        return a + self.part(JOIN, held) + b

    def zh(self, core, held):
        return self.part(ZH_OPEN, held) + core.rstrip("？?") + self.part(ZH_CLOSE, held)


def held_out_comments(cases_path):
    """Normalised comments of the replay's cases, which training must not contain."""
    import json
    out = set()
    for line in open(cases_path, encoding="utf-8"):
        if line.strip():
            out.add(_norm(json.loads(line)["comment"]))
    return out


def same_comment(a_norm_set, comment):
    return _norm(comment) in a_norm_set
